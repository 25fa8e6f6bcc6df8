"""Build a tensor-parallel target engine: avspec.trtllm.hf_engine with `--tp_size N` added to
TensorRT-LLM's stock converter (trtllm-build then writes rank0..rankN-1.engine from the
checkpoint's mapping, with the same draft-token settings as a TP=1 build).

    python3 build_tp_engine.py TARGET_DIR ENGINE_DIR TP GPU_VALUES_JSON
"""

import json
import sys
from pathlib import Path

from avspec.trtllm import hf_engine

target, engine_dir, tp, values_file = sys.argv[1:5]
values = json.loads(Path(values_file).read_text())
stock = hf_engine.convert_command


def convert_command(*args, **kwargs):
    return [*stock(*args, **kwargs), "--tp_size", tp, "--workers", tp]


hf_engine.convert_command = convert_command
sys.exit(
    hf_engine.main(
        [
            target,
            "--out",
            f"/tmp/avspec_checkpoint_tp{tp}",
            "--build",
            engine_dir,
            "--dtype",
            "float16",
            "--max-batch-size",
            values["triton_max_batch_size"],
            "--max-seq-len",
            values["max_seq_len"],
        ]
    )
)
