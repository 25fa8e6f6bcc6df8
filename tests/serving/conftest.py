"""One real Triton server per test session, on free ports, over a tmp copy of the repository.

The copy points the draft and target at a tiny seeded model pair saved in a tmp directory (the
target's weights plus small noise as the draft, so acceptance is partial), writes the estimator
snapshot to tmp and refits every 10 steps so the coefficients move within a few requests.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from avspec.model_dir import save_model_dir
from avspec.serving.metrics import metric_value, parse_metrics
from avspec.serving.repository import build_test_repository
from avspec.serving.server_process import ServerProcess
from avspec.tokenizer import ByteTokenizer
from avspec.transformer import Transformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"
K = 8
MAX_LENGTH = 256
REFIT_INTERVAL = 10
ADMIN_KEY = "serving-tests-admin-key-0123456789"  # the operator's key: admin calls go through


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serving)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_pair(directory: Path, seed: int = 0) -> tuple[Path, Path]:
    """Save a seeded random target and a noisy copy of it as the draft; return their dirs.

    Random init makes a copy machine (tied embeddings: the residual argmax is the input token),
    so the block matrices are scaled up 6x; embeddings outside printable ASCII and newline are
    scaled down, so outputs are text whose characters map one to one onto tokens.
    """
    torch.manual_seed(seed)  # test code: Transformer initialises from the global generator
    generator = torch.Generator().manual_seed(seed)
    config = TransformerConfig(num_layers=2, width=64, num_heads=2, max_length=MAX_LENGTH)
    target, draft = Transformer(config), Transformer(config)
    printable = torch.zeros(config.vocab_size, dtype=torch.bool)
    printable[32:127] = True
    printable[10] = True
    with torch.no_grad():
        for (name, t), d in zip(target.named_parameters(), draft.parameters(), strict=True):
            if name.startswith("blocks.") and t.dim() == 2:
                t.mul_(6.0)
            if name == "embed.weight":
                t[~printable] *= 0.1
            noise = torch.randn(t.shape, generator=generator) * 0.3 * t.std().clamp_min(1e-3)
            d.copy_(t + noise)
    save_model_dir(directory / "target", target, ByteTokenizer())
    save_model_dir(directory / "draft", draft, ByteTokenizer())
    return directory / "target", directory / "draft"


def stage_overrides(model_dir: Path) -> dict[str, object]:
    return {"model_dir": model_dir, "max_sequences": 40, "max_length": MAX_LENGTH}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The running server; its log is in the tmp dir and printed if it fails to start."""
    tmp = tmp_path_factory.mktemp("serving")
    target_dir, draft_dir = save_tiny_pair(tmp / "models")
    repository = build_test_repository(
        REPOSITORY,
        tmp / "model_repository",
        {
            "draft": stage_overrides(draft_dir),
            "target": stage_overrides(target_dir),
            "verifier": {
                "refit_interval": REFIT_INTERVAL,
                "snapshot_path": tmp / "estimator_snapshot.json",
                "cost_tables": tmp / "no_cost_tables.json",
            },
            "speculative": {"max_batch_size": 32, "max_context": MAX_LENGTH},
        },
    )
    log = tmp / "tritonserver.log"
    process = ServerProcess(
        repository,
        free_port(),
        free_port(),
        free_port(),
        exit_timeout_s=5,
        log_path=log,
        admin_key=ADMIN_KEY,
    )
    try:
        process.start()
    except Exception:
        print(log.read_text()[-6000:])
        raise
    process.snapshot_path = tmp / "estimator_snapshot.json"
    yield process
    process.stop()


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
