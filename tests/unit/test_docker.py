"""docker/: compose, Prometheus and Grafana files validate; the dashboard queries exported metrics.

The YAML files are written in YAML's JSON-compatible flow style (plus `#` comment lines), so the
standard library validates them here; tests/serving/test_dashboard.py checks the dashboard's
metric names against a scrape of the running CPU server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from avspec.serving.metrics import ALL_METRICS, HISTOGRAM

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "adaptive_verification.json"
METRIC = re.compile(r"\b((?:av|nv)_[a-z_]+)\b")
TRITON_METRICS = {"nv_inference_request_success"}


def load_jsonish(path: Path):
    """A JSON-style YAML file: drop `#` comment lines, parse the rest as JSON."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    return json.loads("\n".join(lines))


def exported_names() -> set[str]:
    """Sample names the deployment exports (histograms as _bucket, _sum and _count)."""
    names = set()
    for spec in ALL_METRICS:
        if spec.kind == HISTOGRAM:
            names |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
        else:
            names.add(spec.name)
    return names


def dashboard_metric_names(dashboard: dict) -> set[str]:
    return {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in METRIC.findall(target["expr"])
    }


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_jsonish(DOCKER / "compose.yaml")


def test_compose_services_build_and_mount_existing_files(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"triton", "prometheus", "grafana"}
    build = services["triton"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    devices = services["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "8002:8002" in services["triton"]["ports"]
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d[\w.]*", image), f"{name} image must be pinned: {image}"
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert (DOCKER / source).exists(), volume
    named = {v.split(":")[0] for v in services["triton"]["volumes"] if not v.startswith(("$", "."))}
    assert named <= set(compose["volumes"])


def test_dockerfile_uses_the_trtllm_image_and_copies_what_exists() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert "ARG TRITON_TAG=24.12" in text
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3" in text
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    for kept in ("backend/avspec", "model_repository/", "model_repository_gpu/", "client/"):
        assert f"!{kept}" in ignore, kept
    entry = DOCKER / "serve_gpu.sh"
    assert os.access(entry, os.X_OK)
    subprocess.run(["bash", "-n", str(entry)], check=True)


def test_serve_script_loads_exactly_the_gpu_deployment() -> None:
    def config(name: str) -> mc.ModelConfig:
        for directory in (ROOT / "model_repository" / name, ROOT / "model_repository_gpu" / name):
            for path in (directory / "configs" / "gpu.pbtxt", directory / "config.pbtxt"):
                if path.is_file():
                    return text_format.Parse(path.read_text(), mc.ModelConfig())
        raise AssertionError(name)

    def param(cfg: mc.ModelConfig, key: str) -> str:
        return cfg.parameters[key].string_value

    step_model = param(config("speculative"), "step_model")
    steps = [s.model_name for s in config(step_model).ensemble_scheduling.step]
    engine = param(config("trtllm_target"), "trtllm_model")
    wanted = {"speculative", step_model, *steps, engine}
    loaded = set(re.findall(r"--load-model=(\w+)", (DOCKER / "serve_gpu.sh").read_text()))
    assert loaded == wanted


def test_prometheus_scrapes_the_metrics_port(compose: dict) -> None:
    config = load_jsonish(DOCKER / "prometheus.yml")
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets["triton"] == ["triton:8002"]
    assert "triton" in compose["services"]
    assert targets["host"] == ["host.docker.internal:8002"]
    assert "host.docker.internal:host-gateway" in compose["services"]["prometheus"]["extra_hosts"]


def test_grafana_provisioning_points_at_the_dashboard(compose: dict) -> None:
    datasources = load_jsonish(DOCKER / "grafana/provisioning/datasources/prometheus.yaml")
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = load_jsonish(DOCKER / "grafana/provisioning/dashboards/avspec.yaml")
    path = providers["providers"][0]["options"]["path"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == path
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])


def test_dashboard_is_well_formed_and_covers_every_av_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["targets"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in panel["targets"])
    queried = dashboard_metric_names(dashboard)
    assert queried - TRITON_METRICS <= exported_names(), queried - exported_names()
    for spec in ALL_METRICS:
        assert any(name.startswith(spec.name) for name in queried), f"no panel for {spec.name}"


def test_entry_script_builds_the_engine_once_then_serves(tmp_path: Path) -> None:
    """docker/serve_gpu.sh on the CPU, with stand-ins for the two GPU programs: the real export
    runs, `trtllm-build` gets the deployment's flags and sizes from the values file, the filled
    repository has no placeholder left, and a second start reuses the engine."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stand_ins = {
        "python3": f'exec "{sys.executable}" "$@"\n',  # the venv's: torch, safetensors
        # records its arguments and writes an engine file where --output_dir points
        "trtllm-build": 'echo "trtllm-build $*" >> "$LOG"\n'
        'while [ "$1" != "--output_dir" ]; do shift; done\n'
        'mkdir -p "$2" && touch "$2/rank0.engine"\n',
        "tritonserver": 'echo "tritonserver $*" >> "$LOG"\n',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    engine = tmp_path / "engines" / "target"
    values = json.loads((DOCKER / "gpu_values.example.json").read_text())
    values |= {"engine_dir": str(engine), "triton_max_batch_size": "16", "max_seq_len": "256"}
    (tmp_path / "values.json").write_text(json.dumps(values))
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LOG": str(log),
        "AVSPEC_ROOT": str(tmp_path / "root"),
        "AVSPEC_GPU_VALUES": str(tmp_path / "values.json"),
        "PYTHONPATH": str(ROOT / "backend"),
    }
    (tmp_path / "root").mkdir()
    for name in ("models", "client", "model_repository", "model_repository_gpu"):
        (tmp_path / "root" / name).symlink_to(ROOT / name)

    for _ in range(2):
        subprocess.run(["bash", str(DOCKER / "serve_gpu.sh")], env=env, check=True)
    calls = log.read_text().splitlines()
    builds = [c for c in calls if c.startswith("trtllm-build")]
    assert len(builds) == 1 and len(calls) == 3, calls
    build = builds[0].split()
    assert build[build.index("--max_batch_size") + 1] == "16"
    assert build[build.index("--max_seq_len") + 1] == "256"
    assert build[build.index("--speculative_decoding_mode") + 1] == "draft_tokens_external"
    checkpoint = Path(build[build.index("--checkpoint_dir") + 1])
    assert (
        json.loads((checkpoint / "config.json").read_text())["architecture"] == "LlamaForCausalLM"
    )
    assert "--model-config-name=gpu" in calls[-1]
    filled = tmp_path / "root" / "build" / "model_repository_gpu"
    for config in filled.rglob("config.pbtxt"):
        assert "${" not in config.read_text(), config
    assert str(engine) in (filled / "tensorrt_llm" / "config.pbtxt").read_text()


def test_trtllm_extra_is_pinned_optional_and_matches_the_image() -> None:
    """The CPU install never pulls TensorRT-LLM; the extra pins the version the image carries."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = project["optional-dependencies"]["trtllm"]
    name, version = pin.split("==")
    assert name == "tensorrt-llm" and re.fullmatch(r"\d+\.\d+\.\d+", version)
    installed = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    assert not any("tensorrt" in dep for dep in installed)
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[dev]'" in makefile and "trtllm]" not in makefile
    assert f"TensorRT-LLM {version}" in (DOCKER / "Dockerfile").read_text()
