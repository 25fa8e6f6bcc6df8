"""deploy/chart rendered offline by Helm's own engine and validated against Kubernetes schemas.

Helm: `helm-python-sdk` (PyPI; the Helm v4 library compiled into a shared object, so
`Chart.render` is `helm template` and `lint` is `helm lint`), values checked against the chart's
values.schema.json by the same engine. Kubernetes: `kubernetes-validate` (PyPI; the JSON schemas
of the Kubernetes API, strict: unknown fields fail). Both are pinned dev dependencies
(pyproject.toml, constraints.txt). Custom resources (PodMonitor, ServiceMonitor, PrometheusRule,
LeaderWorkerSet) have no schema there: their fields are checked here one by one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from helpers.ci import missing_tool

CHART = ROOT / "deploy" / "chart"
KUBERNETES = "1.30.0"  # the oldest API the chart claims (kubeVersion >= 1.27; 1.30 schemas)
INSTALL = "pip install -c constraints.txt -e '.[dev]' (make venv does it)"


def _tools():
    try:
        import helm_python
        import kubernetes_validate
    except ImportError as err:
        missing_tool(f"{err.name} missing", INSTALL)
    return helm_python, kubernetes_validate


def render(values: dict | None = None, namespace: str = "llm") -> list[dict]:
    helm, _ = _tools()
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values or {}, name="demo", namespace=namespace)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def validate_core(docs: list[dict]) -> None:
    """Strict schema validation of every built-in kind (custom resources are checked apart)."""
    _, kv = _tools()
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com", "leaderworkerset.x-k8s.io")):
            continue
        kv.validate(doc, KUBERNETES, strict=True)


def serving_container(docs: list[dict]) -> dict:
    [deployment] = by_kind(docs, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_default_values_render_lint_and_validate():
    helm, _ = _tools()
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]
    docs = render()
    validate_core(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ConfigMap",
        "ConfigMap",
        "Deployment",
        "PodMonitor",
        "PrometheusRule",
        "Service",
    ]
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = serving_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    # strict readiness: the front's /v2/health/ready (every model, the engine included, and
    # every stage process ready); liveness on /v2/health/live; a startup probe long enough for
    # the first start's engine build
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True and mounts["shm"]["mountPath"] == "/dev/shm"
    assert "prior" not in mounts and "readOnly" not in mounts["runs"]  # own snapshot: writable
    values = env(container)
    assert values["AVSPEC_NUM_DRAFT_TOKENS"] == "8" and values["AVSPEC_TP_SIZE"] == "1"
    assert values["AVSPEC_TARGET_MODEL"] == "/mnt/models/target"
    [service] = by_kind(docs, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 8002,
    }
    assert service["spec"]["selector"]["avspec.io/role"] == "serving"
    assert not by_kind(docs, "HorizontalPodAutoscaler")  # autoscaling is off by default


def test_image_is_the_ngc_tag_of_docker():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    tag = re.search(r"^ARG TRITON_TAG=(\S+)$", dockerfile, re.M).group(1)
    assert "nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3" in dockerfile
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["tag"] == chart["appVersion"] == tag
    assert serving_container(render())["image"] == f"avspec-triton-trtllm:{tag}"


def test_rules_use_metrics_the_server_exports():
    docs = render()
    [rule] = by_kind(docs, "PrometheusRule")
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    names = {r.get("alert") or r.get("record") for r in rules}
    assert {
        "AvspecFleetAcceptanceLow",
        "AvspecQueueOverCompute",
        "AvspecEstimatorMiscalibrated",
    } <= names
    documented = set(re.findall(r"`(av_[a-z_]+)`", (ROOT / "docs" / "serving.md").read_text()))
    triton = {"nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"}
    for r in rules:
        used = set(re.findall(r"\b((?:av|nv)_[a-z_]+)\b", r["expr"]))
        assert used <= documented | triton, (r["expr"], used - documented - triton)
        assert r["expr"].count("(") == r["expr"].count(")") and r["expr"].count("{") == r[
            "expr"
        ].count("}")
    # the fleet view is per pod: calibration and queue ratio are never summed over pods
    calibration = next(r for r in rules if r.get("alert") == "AvspecEstimatorMiscalibrated")
    assert "sum" not in calibration["expr"] and 'namespace="llm"' in calibration["expr"]
    [monitor] = by_kind(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    service_monitor = by_kind(render({"monitoring": {"kind": "ServiceMonitor"}}), "ServiceMonitor")
    assert service_monitor[0]["spec"]["endpoints"][0]["port"] == "metrics"
    assert not by_kind(render({"monitoring": {"enabled": False}}), "PrometheusRule")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": "two"}, "replicas"),
        ({"replicas": 0}, "replicas"),
        ({"speculative": {"numDraftTokens": 9}}, "numDraftTokens"),
        ({"resources": {"sharedMemory": "lots"}}, "sharedMemory"),
        ({"image": {"tag": ""}}, "tag"),
        ({"probes": {"readiness": {"path": "/"}}}, "path"),
        ({"autoscaling": {"enabled": "yes"}}, "enabled"),
        ({"monitoring": {"kind": "Prometheus"}}, "kind"),
        ({"nmDraftTokens": 4}, "nmDraftTokens"),
        ({"tensorParallel": {"size": 3, "nodes": 2}}, "multiple of tensorParallel.nodes"),
        ({"tensorParallel": {"size": 4, "nodes": 2}}, "engine.claimName"),
        ({"estimator": {"prior": {"configMap": "a", "claimName": "b"}}}, "not both"),
    ],
)
def test_a_broken_value_fails_the_render(values, message):
    helm, _ = _tools()
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_the_prior_is_mounted_read_only_into_every_pod():
    docs = render({"estimator": {"prior": {"configMap": "fleet-prior"}}, "replicas": 3})
    validate_core(docs)
    container = serving_container(docs)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["prior"] == {"name": "prior", "mountPath": "/etc/avspec/prior", "readOnly": True}
    assert env(container)["AVSPEC_PRIOR"] == "/etc/avspec/prior/estimator_prior.json"
    [deployment] = by_kind(docs, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["prior"]["configMap"]["name"] == "fleet-prior"
    assert volumes["runs"] == {"name": "runs", "emptyDir": {}}
    claim = render({"estimator": {"prior": {"claimName": "priors"}}})
    [deployment] = by_kind(claim, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["prior"]["persistentVolumeClaim"] == {"claimName": "priors", "readOnly": True}


def test_autoscaling_on_queue_time_when_enabled():
    docs = render({"autoscaling": {"enabled": True, "maxReplicas": 6}})
    validate_core(docs)
    [hpa] = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "demo-avspec",
    }
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "avspec_queue_to_compute_ratio"
    [deployment] = by_kind(docs, "Deployment")
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    [rule] = by_kind(docs, "PrometheusRule")
    records = {r.get("record") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "avspec_queue_to_compute_ratio" in records  # what the adapter serves to the HPA


def test_tensor_parallel_in_one_pod():
    docs = render({"tensorParallel": {"size": 4}})
    validate_core(docs)
    container = serving_container(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert env(container)["AVSPEC_TP_SIZE"] == "4"
    [values] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("values")]
    gpu_values = json.loads(values["data"]["gpu_values.json"])
    assert gpu_values["engine_dir"] == "/engines/target-tp4"  # one engine per TP size
    example = json.loads((ROOT / "docker" / "gpu_values.example.json").read_text())
    assert set(gpu_values) == set(example)  # every key docker/serve_gpu.sh reads


def test_tensor_parallel_across_nodes_is_a_leader_worker_set():
    docs = render({"tensorParallel": {"size": 8, "nodes": 2}, "engine": {"claimName": "engines"}})
    validate_core(docs)
    assert not by_kind(docs, "Deployment")
    [lws] = by_kind(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and lws["spec"]["replicas"] == 2
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert env(leader)["AVSPEC_MPI_NODES"] == "2" and env(leader)["AVSPEC_TP_SIZE"] == "8"
    # the draft, the verifier and the front run on the leader only
    assert leader["command"][-1].endswith("start.sh") and "readinessProbe" in leader
    assert "start.sh" not in " ".join(worker["command"]) and "ports" not in worker
    assert template["workerTemplate"]["metadata"]["labels"]["avspec.io/role"] == "tp-worker"
    [service] = by_kind(docs, "Service")
    assert service["spec"]["selector"]["avspec.io/role"] == "serving"
    # the core parts of the custom resource's pods pass the Pod schema
    _, kv = _tools()
    for part in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}
        kv.validate({**pod, "spec": template[part]["spec"]}, KUBERNETES, strict=True)


def scripts() -> dict[str, str]:
    [cm] = [d for d in by_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("scripts")]
    return cm["data"]


def test_mpi_wrapper_puts_the_python_models_on_rank_zero_only(tmp_path: Path):
    wrapper = tmp_path / "tritonserver_mpi.sh"
    wrapper.write_text(scripts()["tritonserver_mpi.sh"])
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mpirun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (fake / "mpirun").chmod(0o755)
    launcher_args = [
        "--model-repository=/tmp/pair/model_repository",
        "--model-repository=/opt/avspec/build/model_repository_gpu",
        "--model-config-name=gpu",
        "--model-control-mode=explicit",
        "--load-model=draft",
        "--load-model=verifier",
        "--load-model=tensorrt_llm",
        "--http-port=40001",
    ]
    run_env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "AVSPEC_TP_SIZE": "4"}
    run_env["AVSPEC_REAL_TRITONSERVER"] = "/opt/tritonserver/bin/tritonserver"
    out = subprocess.run(
        ["bash", str(wrapper), *launcher_args], env=run_env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    ranks = "\n".join(out.stdout.splitlines()).split("\n:\n")
    assert len(ranks) == 4
    assert ranks[0].splitlines()[-len(launcher_args) :] == launcher_args  # rank 0: everything
    for rank in ranks[1:]:
        args = rank.splitlines()
        loads = [a for a in args if a.startswith("--load-model=")]
        assert loads == ["--load-model=tensorrt_llm"], args
        assert "--allow-http=false" in args and not any(a.startswith("--http-port") for a in args)
        assert "--model-repository=/opt/avspec/build/model_repository_gpu" in args
    multi = {**run_env, "AVSPEC_TP_SIZE": "8", "AVSPEC_MPI_NODES": "2"}
    multi |= {"LWS_LEADER_ADDRESS": "demo-avspec-0.demo-avspec.llm", "LWS_GROUP_INDEX": "0"}
    multi["AVSPEC_LWS_NAME"] = "demo-avspec"
    out = subprocess.run(
        ["bash", str(wrapper), *launcher_args], env=multi, capture_output=True, text=True
    )
    hosts = out.stdout.splitlines()[out.stdout.splitlines().index("--host") + 1]
    assert hosts == "demo-avspec-0.demo-avspec.llm:4,demo-avspec-0-1.demo-avspec:4"


def test_start_script_checks_k_and_copies_the_prior_once(tmp_path: Path):
    start = tmp_path / "start.sh"
    start.write_text(scripts()["start.sh"])
    root = tmp_path / "avspec"
    (root / "model_repository/verifier/configs").mkdir(parents=True)
    (root / "model_repository/verifier/configs/gpu.pbtxt").write_text(
        'parameters { key: "num_positions" value: { string_value: "8" } }\n'
    )
    (root / "docker").mkdir()
    (root / "docker/serve_gpu.sh").write_text("echo serving\n")
    (root / "runs").mkdir()
    prior = tmp_path / "prior.json"
    prior.write_text('{"prior": true}')
    base = {**os.environ, "AVSPEC_ROOT": str(root), "AVSPEC_PRIOR": str(prior)}
    base["AVSPEC_COST_TABLES"] = str(tmp_path / "costs.json")

    def run(k: str):
        return subprocess.run(
            ["bash", str(start)],
            env={**base, "AVSPEC_NUM_DRAFT_TOKENS": k},
            capture_output=True,
            text=True,
        )

    wrong = run("6")
    assert wrong.returncode == 2 and "num_positions=8" in wrong.stderr
    assert not (root / "runs/estimator_snapshot.json").exists()
    right = run("8")
    assert right.returncode == 0 and "serving" in right.stdout, right.stderr
    assert (root / "runs/estimator_snapshot.json").read_text() == '{"prior": true}'
    assert (root / "models/cost_tables_gpu.json").is_symlink()
    (root / "runs/estimator_snapshot.json").write_text('{"own": true}')  # learnt since
    assert run("8").returncode == 0
    assert (root / "runs/estimator_snapshot.json").read_text() == '{"own": true}'


def test_files_are_valid_scripts():
    for name in ("start.sh", "tritonserver_mpi.sh"):
        check = subprocess.run(["bash", "-n", str(CHART / "files" / name)], capture_output=True)
        assert check.returncode == 0, check.stderr
