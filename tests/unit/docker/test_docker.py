"""docker/: compose, Prometheus and Grafana files validate; the dashboard queries exported metrics.

The YAML files are written in YAML's JSON-compatible flow style (plus `#` comment lines), so the
standard library validates them here; tests/serving/test_dashboard.py checks the dashboard's
metric names against a scrape of the running CPU server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import text_format
from helpers import ROOT
from tritonclient.grpc import model_config_pb2 as mc

from avspec.serving.host.server_process import free_port
from avspec.serving.repository import read_config_parameters
from avspec.serving.stages.metrics import ALL_METRICS, HISTOGRAM

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


# A stand-in tritonserver, run by the launcher: records its argv, starts one stand-in stub per
# Python-backend model it loads (argv shaped like the real stub's, so the launcher's supervisor
# finds them) and answers readiness and a repository index on its --http-address (a Unix socket),
# as Triton would.
_FAKE_TRITONSERVER = """
import json, os, socketserver, subprocess, sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

argv = sys.argv[1:]
with open(os.environ["LOG"], "a") as log:
    log.write("tritonserver " + json.dumps(argv) + "\\n")
flags = [a.split("=", 1) for a in argv if "=" in a]
def values(name): return [v for k, v in flags if k == name]
loaded, config_name = values("--load-model"), values("--model-config-name")
stubs = []
for model in loaded:
    for repository in map(Path, values("--model-repository")):
        config = repository / model / "configs" / f"{config_name[0]}.pbtxt"
        config = config if config.is_file() else repository / model / "config.pbtxt"
        if config.is_file() and 'backend: "python"' in config.read_text():
            stubs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                "triton_python_backend_stub", str(repository / model / "1" / "model.py"),
                f"shm_{model}"]))

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def answer(self, ok, body=b"{}"):
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        ready = {"/v2/health/ready"} | {f"/v2/models/{m}/ready" for m in loaded}
        self.answer(self.path in ready)
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer(self.path == "/v2/repository/index", b"[]")

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

Server(values("--http-address")[0].removeprefix("unix:"), Handler).serve_forever()
"""


def _status(url: str, headers: dict[str, str] | None = None) -> int:
    """Status of a POST with an empty JSON body (HTTP errors included)."""
    request = urllib.request.Request(url, data=b"{}", headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _serve_until_ready(env: dict[str, str], out: Path, timeout_s: float = 180) -> subprocess.Popen:
    """Run serve_gpu.sh (stdout to `out`) until the launcher prints its ready line."""
    with out.open("w") as stdout:
        process = subprocess.Popen(["bash", str(DOCKER / "serve_gpu.sh")], env=env, stdout=stdout)
    deadline = time.monotonic() + timeout_s
    while "avspec: serving" not in out.read_text():
        assert process.poll() is None, f"serve_gpu.sh exited: {out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready in {timeout_s} s: {out.read_text()}"
        time.sleep(0.2)
    return process


def _stop(process: subprocess.Popen, out: Path) -> None:
    """SIGTERM, as `docker stop` sends it: the launcher stops the server and exits 0."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "stopped on SIGTERM" in out.read_text()


@dataclass
class Container:
    """The stand-in container of the entry-script tests: programs on PATH, values, ports, env."""

    log: Path
    engine: Path
    ports: dict[str, int]
    env: dict[str, str]


def stand_in_container(tmp_path: Path, max_seq_len: str, **env: str) -> Container:
    """Stand-ins for python3 (the venv's), `trtllm-build` (records its arguments, writes an
    engine file where --output_dir points) and tritonserver; a values file; a project root of
    symlinks; free public ports; the entry script's environment (plus `env`)."""
    bin_dir, log = tmp_path / "triton" / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    # started as root, the launcher runs the server as its own user, which reads the stand-ins
    # and appends to the log (pytest makes tmp_path 0700)
    tmp_path.chmod(0o755)
    log.touch(mode=0o666)
    log.chmod(0o666)
    (tmp_path / "triton" / "backends").mkdir()  # the layout serve_gpu.sh derives it from
    (tmp_path / "fake_tritonserver.py").write_text(_FAKE_TRITONSERVER)
    stand_ins = {
        "python3": f'exec "{sys.executable}" "$@"\n',  # the venv's: torch, safetensors
        "trtllm-build": 'echo "trtllm-build $*" >> "$LOG"\n'
        'while [ "$1" != "--output_dir" ]; do shift; done\n'
        'mkdir -p "$2" && touch "$2/rank0.engine"\n',
        "tritonserver": f'exec "{sys.executable}" "{tmp_path / "fake_tritonserver.py"}" "$@"\n',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    engine = tmp_path / "engines" / "target"
    values = json.loads((DOCKER / "gpu_values.example.json").read_text())
    values |= {"engine_dir": str(engine), "triton_max_batch_size": "16", "max_seq_len": max_seq_len}
    (tmp_path / "values.json").write_text(json.dumps(values))
    ports = {name: free_port() for name in ("HTTP", "GRPC", "METRICS")}
    environment = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LOG": str(log),
        "AVSPEC_ROOT": str(tmp_path / "root"),
        "AVSPEC_GPU_VALUES": str(tmp_path / "values.json"),
        "PYTHONPATH": str(ROOT / "backend"),
        **{f"AVSPEC_{name}_PORT": str(port) for name, port in ports.items()},
        **env,
    }
    (tmp_path / "root").mkdir()
    for name in ("models", "client", "model_repository_gpu"):
        (tmp_path / "root" / name).symlink_to(ROOT / name)
    # a copy, so that its snapshot directory (runs/) lies here: the one place the server's
    # user writes, which also makes the log writable to the stand-in tritonserver
    shutil.copytree(ROOT / "model_repository", tmp_path / "root" / "model_repository")
    return Container(log, engine, ports, environment)


# TensorRT-LLM's stock converter, as a stand-in: records its arguments, writes a config.json.
_FAKE_CONVERT = """
import json, os, sys
with open(os.environ["LOG"], "a") as log:
    log.write("convert " + json.dumps([sys.argv[0], *sys.argv[1:]]) + "\\n")
out = sys.argv[sys.argv.index("--output_dir") + 1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({"architecture": "LlamaForCausalLM"}, f)
"""


def hf_pair_and_converters(tmp_path: Path) -> dict[str, str]:
    """A tiny Hugging Face pair (the target's embedding padded by 8 rows) and stand-in stock
    converters in a TRTLLM_EXAMPLES folder: the entry script's environment for them."""
    from helpers.hf_dirs import save_hf_dir, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    vocab = tok.get_vocab_size()
    draft = save_hf_dir(tmp_path / "draft-hf", tiny_llama(vocab, seed=1), tok)
    target = save_hf_dir(tmp_path / "target-hf", tiny_llama(vocab + 8, seed=2), tok)
    examples = tmp_path / "trtllm_examples"
    for family in ("llama", "qwen"):
        (examples / family).mkdir(parents=True)
        (examples / family / "convert_checkpoint.py").write_text(_FAKE_CONVERT)
    return {
        "AVSPEC_TARGET_MODEL": str(target), "AVSPEC_DRAFT_MODEL": str(draft),
        "AVSPEC_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "TRTLLM_EXAMPLES": str(examples),
    }  # fmt: skip


def test_entry_script_builds_the_engine_once_then_serves_behind_the_front(tmp_path: Path) -> None:
    """docker/serve_gpu.sh on the CPU with a tiny Hugging Face pair, with stand-ins for the GPU
    programs: the stock converter runs once, `trtllm-build` gets the deployment's flags and sizes
    from the values file, the filled repository has no placeholder left, a second start reuses
    the engine, and both starts run the stand-in tritonserver through the launcher: Unix sockets
    only, no key, both repositories with the gpu configs, the script's load list, public ports
    held by the front."""
    box = stand_in_container(tmp_path, max_seq_len="128", **hf_pair_and_converters(tmp_path))
    log, engine, ports, env = box.log, box.engine, box.ports, box.env
    admin_key = "container-admin-key-0123456789"
    (tmp_path / "admin.key").write_text(admin_key + "\n")
    front = f"http://127.0.0.1:{ports['HTTP']}"

    out = [tmp_path / "first.out", tmp_path / "second.out"]
    process = _serve_until_ready(env, out[0])  # first start: builds the engine; admin closed
    try:
        with urllib.request.urlopen(f"{front}/v2/health/ready", timeout=10) as response:
            assert response.status == 200  # forwarded by the front to the stand-in
        assert _status(f"{front}/v2/repository/index") == 403  # refused by the front
        assert _status(f"{front}/v2/models/draft/infer") == 403  # an internal stage
        _stop(process, out[0])
        keyed = env | {"AVSPEC_ADMIN_KEY_FILE": str(tmp_path / "admin.key")}
        process = _serve_until_ready(keyed, out[1])
        assert _status(f"{front}/v2/repository/index", {"avspec-admin-key": admin_key}) == 200
        assert _status(f"{front}/v2/repository/index", {"avspec-admin-key": "x" * 20}) == 403
        _stop(process, out[1])
    finally:
        if process.poll() is None:  # SIGTERM first: the launcher takes the server down with it
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    calls = log.read_text().splitlines()
    names = ["convert", "trtllm-build", "tritonserver", "tritonserver"]
    assert [c.split()[0] for c in calls] == names, calls  # the second start reuses the engine
    build = calls[1].split()
    assert build[build.index("--max_batch_size") + 1] == "16"
    assert build[build.index("--max_seq_len") + 1] == "128"
    assert build[build.index("--speculative_decoding_mode") + 1] == "draft_tokens_external"
    checkpoint = Path(build[build.index("--checkpoint_dir") + 1])
    assert (
        json.loads((checkpoint / "config.json").read_text())["architecture"] == "LlamaForCausalLM"
    )
    filled = tmp_path / "root" / "build" / "model_repository_gpu"
    for config in filled.rglob("config.pbtxt"):
        assert "${" not in config.read_text(), config
    assert str(engine) in (filled / "tensorrt_llm" / "config.pbtxt").read_text()
    servers = [json.loads(c.removeprefix("tritonserver ")) for c in calls[2:]]
    for argv in servers:
        _assert_launched_behind_the_front(argv, ports, filled, tmp_path / "triton" / "backends")
    # the operator's key opens the admin API at the front only: it is on no command line
    assert not any(admin_key in a for argv in servers for a in argv)
    assert not any(admin_key in a for a in servers[0])


def _assert_launched_behind_the_front(
    argv: list[str], ports: dict[str, int], filled: Path, backends: Path
) -> None:
    """The tritonserver command the launcher built for the container."""
    flags = [arg.partition("=")[::2] for arg in argv]  # (flag, value), value "" if none
    served, gpu = (v for k, v in flags if k == "--model-repository")
    # model_repository as the launcher rewrote it for the pair (a temporary copy), then the
    # filled one
    assert Path(served).name == "model_repository" and Path(served) != ROOT / "model_repository"
    assert gpu == str(filled.resolve())
    script = (DOCKER / "serve_gpu.sh").read_text()
    assert [v for k, v in flags if k == "--load-model"] == re.findall(r"--load-model=(\w+)", script)
    single = {k: v for k, v in flags if k not in ("--model-repository", "--load-model")}
    assert single["--model-config-name"] == "gpu"
    assert single["--backend-directory"] == str(backends)
    assert single["--model-control-mode"] == "explicit"
    # Triton itself on Unix sockets in one private directory, its metrics on loopback; the
    # public ports (metrics included) are the front's; no key of any kind on the command line
    http, grpc = single["--http-address"], single["--grpc-address"]
    assert http.startswith("unix:/") and grpc.startswith("unix:/")
    assert Path(http[5:]).parent == Path(grpc[5:]).parent
    assert single["--metrics-address"] == "127.0.0.1"
    assert single["--metrics-port"] != str(ports["METRICS"])
    assert single["--exit-timeout-secs"] == "30"
    assert not [k for k, _ in flags if "restricted" in k]


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


def test_entry_script_converts_a_hugging_face_target_with_the_stock_converter(
    tmp_path: Path,
) -> None:
    """An HF pair (AVSPEC_DRAFT_MODEL / AVSPEC_TARGET_MODEL): the first start runs TensorRT-LLM's
    llama converter from TRTLLM_EXAMPLES with the target, the checkpoint directory and float16,
    then `trtllm-build` with the draft-token settings; the engine's vocab_size comes from the
    target's config.json; the launcher serves the pair (its draft in the gpu config)."""
    pair = hf_pair_and_converters(tmp_path)
    target, draft = Path(pair["AVSPEC_TARGET_MODEL"]), Path(pair["AVSPEC_DRAFT_MODEL"])
    examples, checkpoint = Path(pair["TRTLLM_EXAMPLES"]), Path(pair["AVSPEC_CHECKPOINT_DIR"])
    vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
    box = stand_in_container(tmp_path, max_seq_len="128", **pair)
    log, env = box.log, box.env

    out = tmp_path / "first.out"
    process = _serve_until_ready(env, out)
    try:
        # while it serves: the launcher's copy of model_repository holds the pair's draft in
        # the config the GPU server loads
        (line,) = (c for c in log.read_text().splitlines() if c.startswith("tritonserver "))
        argv = json.loads(line.removeprefix("tritonserver "))
        served = next(a for a in argv if a.startswith("--model-repository=")).split("=", 1)[1]
        draft_gpu = (Path(served) / "draft" / "configs" / "gpu.pbtxt").read_text()
        assert read_config_parameters(draft_gpu)["model_dir"] == str(draft)
        _stop(process, out)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["convert", "trtllm-build", "tritonserver"], calls
    convert = json.loads(calls[0].removeprefix("convert "))
    assert convert == [
        str(examples / "llama" / "convert_checkpoint.py"),
        "--model_dir", str(target),
        "--output_dir", str(checkpoint),
        "--dtype", "float16",
    ]  # fmt: skip
    build = calls[1].split()
    assert build[build.index("--checkpoint_dir") + 1] == str(checkpoint)
    assert build[build.index("--speculative_decoding_mode") + 1] == "draft_tokens_external"
    assert build[build.index("--max_draft_len") + 1] == "8"
    assert build[build.index("--max_batch_size") + 1] == "16"
    assert build[build.index("--max_seq_len") + 1] == "128"
    filled = tmp_path / "root" / "build" / "model_repository_gpu"
    assert f'string_value: "{vocab + 8}"' in (filled / "trtllm_target" / "config.pbtxt").read_text()
