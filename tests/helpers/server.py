"""The serving tests' constants, their tiny model pair and small polling helpers.

The session's server (tests/serving/conftest.py) runs a tiny seeded pair saved by
`save_tiny_pair`: the target's weights plus small noise as the draft, so acceptance is partial.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from avspec.av.cost_file import save_step_cost
from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost
from avspec.runtime.transformer import Transformer
from avspec.serving.host.server_process import ServerProcess, free_port
from avspec.serving.host.settings import (
    ModelSettings,
    NetworkSettings,
    SecuritySettings,
    ServeSettings,
    TritonSettings,
)
from avspec.serving.repository import copy_repository
from avspec.serving.stages.metrics import metric_value, parse_metrics
from helpers import ROOT
from helpers.hf_dirs import byte_piece_text, byte_tokenizer, llama_form_config, save_transformer_dir

REPOSITORY = ROOT / "model_repository"
K = 8
MAX_LENGTH = 256
REFIT_INTERVAL = 10
ADMIN_KEY = "serving-tests-admin-key-0123456789"  # the operator's key: admin calls go through


def save_tiny_pair(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """Save a seeded random Llama-form target and a noisy copy of it as the draft, both as
    LlamaForCausalLM directories with the byte-level tokenizer (`byte_tokenizer`: one piece per
    byte plus EOS); return their dirs.

    Random init makes a copy machine (tied embeddings: the residual argmax is the input token),
    so the block matrices are scaled up 6x; embeddings of every token whose piece is not
    printable ASCII or newline (EOS and bytes above 127 included) are scaled down, so outputs
    are text whose characters map one to one onto tokens.
    """
    torch.manual_seed(seed)  # test code: Transformer initialises from the global generator
    generator = torch.Generator().manual_seed(seed)
    tok = byte_tokenizer()
    config = llama_form_config(max_length=MAX_LENGTH)
    target, draft = Transformer(config), Transformer(config)
    printable = torch.zeros(config.vocab_size, dtype=torch.bool)
    for token_id in range(config.vocab_size):
        text = byte_piece_text(tok, token_id)
        printable[token_id] = text is not None and (text == "\n" or " " <= text <= "~")
    with torch.no_grad():
        for (name, t), d in zip(target.named_parameters(), draft.parameters(), strict=True):
            if name.startswith("blocks.") and t.dim() == 2:
                t.mul_(6.0)
            if name == "embed.weight":
                t[~printable] *= 0.1
            noise = torch.randn(t.shape, generator=generator) * 0.3 * t.std().clamp_min(1e-3)
            d.copy_(t + noise)
    save_transformer_dir(directory / "target", target, tok)
    save_transformer_dir(directory / "draft", draft, tok)
    return directory / "target", directory / "draft"


def write_steep_draft_costs(path: Path) -> Path:
    """A cost-tables file where a draft pass costs 30 ms and a verified token 0.05 ms."""
    cost = StepCost(
        CostTable([1, 64], [30.0, 31.0], name="draft_pass"),
        CostTable([1, 4096], [5.0, 5.0 + 0.05 * 4095], name="verify"),
        overhead_ms=2.0,
    )
    save_step_cost(path, cost, measured=None)
    return path


def stage_overrides(model_dir: Path) -> dict[str, object]:
    # float32: the repository's `auto` is bf16 on a CPU with native bf16, and the tests compare
    # the served tiny pair with float32 references
    return {
        "model_dir": model_dir,
        "max_sequences": 40,
        "max_length": MAX_LENGTH,
        "dtype": "float32",
    }


def scrape(server: ServerProcess) -> dict:
    """Parsed samples of the server's metrics endpoint."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return parse_metrics(response.read().decode())


def wait_for(condition, timeout_s: float = 30.0, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def all_freed(server: ServerProcess) -> bool:
    samples = scrape(server)
    return (
        metric_value(samples, "av_live_sequences") == 0
        and metric_value(samples, "av_kv_live_sequences", model="draft") == 0
        and metric_value(samples, "av_kv_live_sequences", model="target") == 0
    )


def live_processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) of every running, non-zombie process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ")"
        state, ppid, pgid = stat.rpartition(")")[2].split()[:3]
        if state not in ("Z", "X"):
            found[int(entry.name)] = (int(ppid), int(pgid), cmdline)
    return found


def readable_by_server(directory: Path) -> Path:
    """`directory` opened to the server's user (pytest creates its tmp directories 0700;
    started as root, the server runs as another user, which must read its repository)."""
    directory.chmod(0o755)
    return directory


# ChatML, the template of Qwen2 and SmolLM2 instruct models: the OpenAI chat route's tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def add_chat_template(model_dir: Path) -> None:
    """Give `model_dir`'s tokenizer_config.json the chat template CHAT_TEMPLATE."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))


def write_test_repository(tmp: Path) -> tuple[Path, Path]:
    """(repository, target model dir): a tmp copy of the repository on the tiny pair, with the
    snapshot at `tmp/estimator_snapshot.json` (see the module doc)."""
    target_dir, draft_dir = save_tiny_pair(tmp / "models")
    add_chat_template(target_dir)
    repository = copy_repository(
        REPOSITORY,
        tmp / "model_repository",
        {
            "draft": stage_overrides(draft_dir),
            "target": stage_overrides(target_dir),
            "verifier": {
                "refit_interval": REFIT_INTERVAL,
                # the tiny pair's starting coefficients (the repository's are the default pair's)
                "initial_slope": 0.5,
                "initial_intercept": -0.2,
                "snapshot_path": tmp / "estimator_snapshot.json",
                "step_log": tmp / "step_log.jsonl",  # replayed by tests/serving/test_bench.py
                "cost_tables": write_steep_draft_costs(tmp / "cost_tables.json"),
                "cost_refresh": "false",  # keep the steep tables: the refresh would follow
                # this machine, where the tiny draft's pass costs well under a millisecond
            },
            "speculative": {"max_batch_size": 32, "max_context": MAX_LENGTH},
        },
    )
    return repository, target_dir


def start_test_server(tmp: Path) -> ServerProcess:
    """A started server over `write_test_repository(tmp)`; its log is `tmp/tritonserver.log`,
    printed if it fails to start."""
    repository, target_dir = write_test_repository(tmp)
    log = tmp / "tritonserver.log"
    process = ServerProcess(
        ServeSettings(
            ModelSettings((repository,)),
            NetworkSettings(free_port(), free_port(), free_port()),
            TritonSettings(exit_timeout_s=5, log_path=log),
            SecuritySettings(admin_key=ADMIN_KEY),
        )
    )
    try:
        process.start()
    except Exception:
        print(log.read_text()[-6000:])
        raise
    process.snapshot_path = tmp / "estimator_snapshot.json"
    process.step_log = tmp / "step_log.jsonl"
    process.repository = repository
    process.target_dir = target_dir
    return process


def wait_for_line(path: Path, text: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait until `text` appears in the log `path` of the launcher `process`; fail (with the
    log's end) if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert process.poll() is None, f"launcher exited: {path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s"
        time.sleep(0.1)
