"""The launcher's command line (`python -m avspec.serving.host.launcher --help`).

`parse_args` only parses; avspec.serving.host.settings.ServeSettings.from_args makes the
settings of it (keys read, .gguf models converted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from avspec.serving.exposure import ADMIN_KEY_ENV, ADMIN_KEY_HEADER, API_KEYS_ENV
from avspec.serving.host.host_costs import CACHE_ENV
from avspec.serving.host.sandbox import DEFAULT_SERVER_USER
from avspec.serving.host.settings import ALLOWED_HOSTS_ENV, DEFAULT_GGUF_CACHE
from avspec.serving.repository import ENGINES, SERVING_DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m avspec.serving.host.launcher",
        description="Serve model repositories with tritonserver (by default the one bundled in "
        "nvidia-pytriton) behind the front. Prints one line when every model is ready; "
        "SIGINT/SIGTERM stop it cleanly.",
    )
    parser.add_argument(
        "--model-repository",
        required=True,
        type=Path,
        action="append",
        help="a model repository; repeat to serve several together (a model name may appear "
        "in only one)",
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbosity")
    parser.add_argument("--exit-timeout-secs", type=int, default=10)
    parser.add_argument("--ready-timeout-secs", type=float, default=300.0)
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch CPU threads per model instance (OMP_NUM_THREADS); 0 leaves it unset",
    )
    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="address of the public HTTP, gRPC and metrics ports (an IP; tritonserver itself "
        "listens on 127.0.0.1 behind the front)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help=f"file whose first line opens the admin APIs to clients sending it in header "
        f"'{ADMIN_KEY_HEADER}' (or set {ADMIN_KEY_ENV}); without either they stay closed",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        help=f"file of API keys, one a line ('NAME KEY' or 'KEY'; or set {API_KEYS_ENV}, "
        "comma-separated): inference then needs 'Authorization: Bearer KEY' (401 otherwise) "
        "and each key is its own client for fairness; without keys the client is its address",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,  # ServeSettings.from_args reads the variable
        help="comma-separated Host names the HTTP port answers besides IP addresses and "
        "localhost (e.g. the name a proxy or DNS gives it); '*' answers any (no DNS-rebinding "
        f"guard); default {ALLOWED_HOSTS_ENV}",
    )
    parser.add_argument(
        "--completions-special-tokens",
        action="store_true",
        help="let /v1/completions prompts spell special tokens (by default a prompt is text, "
        "as chat message contents always are)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest HTTP request body / gRPC message accepted (413 / RESOURCE_EXHAUSTED past it)",
    )
    parser.add_argument(
        "--draft-model",
        type=Path,
        help="the draft's model: a directory (a Hugging Face checkpoint, the only format the "
        "runtime serves) or a Llama-family .gguf file, converted once into one under "
        "--gguf-cache; it overrides the draft model's model_dir. With either of --draft-model "
        "and --target-model the pair is checked and described before tritonserver starts, and "
        "a rewritten copy of the repository is served",
    )
    parser.add_argument(
        "--target-model",
        type=Path,
        help="the target's model: a directory or a .gguf file (see --draft-model)",
    )
    # any device's dtypes: the stage checks the one it is given against its own device
    dtypes = sorted({name for names in SERVING_DTYPES.values() for name in names})
    for stage in ("target", "draft"):
        parser.add_argument(
            f"--{stage}-dtype",
            choices=dtypes,
            help=f"the {stage} stage's serving precision (its `dtype` parameter; default: the "
            "repository's, auto): float32, bfloat16, auto; on the CPU weight-only int8 / int4 "
            "or w8a8 (int8 weights and activations), on a GPU float16 "
            "(avspec.runtime.precision)",
        )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        help="both stages' runtime (their `engine` parameter; default: the repository's, auto): "
        "torch (the Hugging Face checkpoint in --*-dtype), llamacpp (llama.cpp's ggml on the "
        "CPU, serving each model directory's model.gguf as it is quantized; `make llamacpp`) "
        "or auto (torch where the CPU has native bfloat16, else llamacpp; printed at start)",
    )
    parser.add_argument(
        "--target-gguf",
        help="llama.cpp's engine: the target's GGUF file in its model directory (default "
        "model.gguf, the file as published; model.Q4_0.gguf after make models QUANT=Q4_0)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        help="threads of each llama.cpp stage (their `threads` parameter; default: the "
        "repository's, 0 = every core)",
    )
    parser.add_argument(
        "--gguf-cache",
        type=Path,
        default=DEFAULT_GGUF_CACHE,
        help="where .gguf models are converted, by the file's sha256 (default: %(default)s, "
        "relative to the working directory, shared with avspec.tools.setup.fetch_target)",
    )
    parser.add_argument(
        "--user",
        help=f"started as root: the user everything runs as once the launcher has dropped "
        f"root (NAME, UID or UID:GID; default {DEFAULT_SERVER_USER}; 'root' keeps root, not "
        f"advised); started as another user, that user",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a dead tritonserver allowed within --restart-window-s (0: exit)",
    )
    parser.add_argument("--restart-window-s", type=float, default=600.0)
    _add_server_choice(parser)
    _add_cost_options(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to execute again as given
    return args


def _add_server_choice(parser: argparse.ArgumentParser) -> None:
    """Options choosing the server and what it loads (the GPU container sets them all)."""
    parser.add_argument(
        "--tritonserver",
        help="tritonserver executable, a path or a name on PATH (default: the one bundled in "
        "nvidia-pytriton, run with the wheel's library and module paths; another one runs in "
        "this environment as is, but for --cpu-threads)",
    )
    parser.add_argument(
        "--backend-directory",
        type=Path,
        help="Triton backend directory, used as is (default: assembled from the wheel for its "
        "server, tritonserver's own default otherwise)",
    )
    parser.add_argument(
        "--model-config-name",
        help="load <model>/configs/NAME.pbtxt where it exists, config.pbtxt otherwise",
    )
    parser.add_argument(
        "--load-model",
        dest="load_models",
        action="append",
        metavar="MODEL",
        help="a model to load; repeat for each (default: every model of the repositories)",
    )


def _add_cost_options(parser: argparse.ArgumentParser) -> None:
    """Options on the verifier's cost tables (avspec.serving.host.host_costs)."""
    parser.add_argument(
        "--cost-tables",
        type=Path,
        help="the verifier's cost tables, a step-cost file (client/profile_costs.py); default: "
        "this host's, measured at first start and cached (needs --draft-model/--target-model)",
    )
    parser.add_argument(
        "--cost-cache",
        type=Path,
        help=f"where this host's cost tables are cached (default ${CACHE_ENV}, else "
        "~/.cache/avspec/costs; started as root /var/cache/avspec/costs)",
    )
    parser.add_argument(
        "--remeasure-costs",
        action="store_true",
        help="measure this host's cost tables again even when cached (make costs)",
    )
    parser.add_argument(
        "--costs-only",
        action="store_true",
        help="resolve (measure when needed) the cost tables, print where they are, and exit",
    )
