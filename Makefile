# One venv, built from pyproject.toml. `make test` and `make serve` work on a fresh clone.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: venv test unit lint format serve models bench soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# Every server-free test (tests/unit); `make test` adds tests/serving, which starts the real server.
unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache

# Serve model_repository/ with the Triton server bundled in nvidia-pytriton (docs/serving.md).
# Admin APIs (model control, repository, config, stats, logging, trace) stay closed unless
# ADMIN_KEY_FILE (or AVSPEC_ADMIN_KEY in the environment) gives the operator's key.
ADMIN_KEY_FILE ?=
# The pair to serve: Hugging Face checkpoint directories (the only model format), checked and
# described by the launcher before tritonserver starts.
DRAFT_MODEL ?= models/draft
TARGET_MODEL ?= models/target
serve: $(STAMP)
	$(PY) -m avspec.serving.launcher --model-repository model_repository \
		--draft-model $(DRAFT_MODEL) --target-model $(TARGET_MODEL) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		$(if $(ADMIN_KEY_FILE),--admin-key-file $(ADMIN_KEY_FILE))

# Retrain the default pair + MODEL_CARD.md: BPE tokenizer, Llama target, draft distilled from it,
# written as Hugging Face checkpoints (reproducible from seed, steps and 2 threads; ~40 min).
models: $(STAMP)
	$(PY) -m avspec.tools.training --out models --seed 0 --target-steps 600 --draft-steps 800 \
		--threads 2

.PHONY: workloads
# Rebuild the prompt sets (code, prose, high_entropy) from the held-out split.
workloads: $(STAMP)
	$(PY) -m avspec.tools.workloads --out workloads

# Reduced serving benchmark (docs/benchmarks.md): starts its own server on free ports; workloads
# code and high_entropy, concurrency 1/4/16/64, arms none/k2/k4/k8/av8/ad8; ~5 min on 2 CPU cores.
# Full sweep: $(PY) client/bench_serving.py --start-server --cost-tables $(BENCH_COSTS) --out bench/full
BENCH_COSTS ?= models/cost_tables.json
bench: $(STAMP)
	$(PY) client/bench_serving.py --start-server \
		$(if $(wildcard $(BENCH_COSTS)),--cost-tables $(BENCH_COSTS)) \
		--concurrency 1,4,16,64 --arms none,k2,k4,k8,av8,ad8 --workloads code,high_entropy \
		--prompts 64 --max-tokens 32 --rounds 2 --warmup-requests 128 --out bench/reduced

# Soak (client/soak.py): starts its own server on free ports, holds 64 concurrent client loops
# (gRPC stream, HTTP generate / generate_stream, a few cancelled) for 10 minutes plus the server
# start; fails on any failed request, >= 10% RSS growth of tritonserver or a stub after the 60 s
# warm-up, or a /dev/shm region left behind. Writes bench/soak/{soak.json,memory.png,summary.txt}.
soak: $(STAMP)
	$(PY) client/soak.py --start-server --duration-s 600 --concurrency 64 --out bench/soak

.PHONY: costs
# Re-measure the verifier's cost tables on this machine (models/cost_tables.json, ~1 min): the
# draft pass by rows and the target by tokens and rows, medians of 30 interleaved repeats,
# isotonic fit. OVERHEAD_MS is the served path's per-step hops, measured on a running server by
# client/profile_serving_costs.py. The server also refreshes the tables online (cost_refresh).
OVERHEAD_MS ?= 5.3
costs: $(STAMP)
	$(PY) client/profile_costs.py --threads 1 --context 128 --max-draft-tokens 8 \
		--draft-rows 1,2,4,8,16,32,64 --verify-batch-sizes 1,4,16,64 --repeats 30 --warmup 3 \
		--overhead-ms $(OVERHEAD_MS) --output models/cost_tables.json --plot bench/cost_tables.png
