"""What the header of each generated config.pbtxt says (avspec.serving.model_configs;
text_format keeps no comments): a paragraph on each model, one line on each parameter (the full
table: docs/serving.md)."""

from __future__ import annotations

TEMPLATE = (
    "TEMPLATE: fill with client/fill_template.py (every placeholder needs a value; docs/gpu.md)."
)
GPU_VARIANT = "loaded by `tritonserver --model-config-name=gpu` (docs/gpu.md)."

# By the file's path in the project.
MODEL_NOTES: dict[str, str] = {
    "model_repository/speculative/config.pbtxt": "Entry point: text in, text out, streamed or "
    "not (decoupled). One scheduler thread batches every live request into one speculative_step "
    "call per decode step (in-flight batching). Interface and examples: docs/serving.md.",
    "model_repository/speculative_step/config.pbtxt": "One speculative decode step for the "
    "whole batch: draft -> verifier -> target. Called once per step by the entry model's "
    "scheduler (BLS). Contract: docs/architecture.md.",
    "model_repository/speculative_step/configs/gpu.pbtxt": "GPU variant of the step ensemble, "
    f"{GPU_VARIANT} draft -> verifier -> trtllm_target, the fan-out adapter in front of the "
    "TensorRT-LLM engine (model_repository_gpu/). Same tensors as ../config.pbtxt.",
    "model_repository/draft/config.pbtxt": "Draft stage of one speculative step "
    "(avspec.engine.draft_stage): StepInputs in, K drafts per sequence out. Tensor contract: "
    "docs/architecture.md. Relative paths resolve against the project root.",
    "model_repository/draft/configs/gpu.pbtxt": f"GPU variant of the draft stage, {GPU_VARIANT} "
    "Same tensors as ../config.pbtxt; the model runs on cuda and hands its outputs to the "
    "verifier and the target as device tensors (model_gpu.py, DLPack), so draft_probs never "
    "crosses to the host.",
    "model_repository/verifier/config.pbtxt": "Adaptive verifier (avspec.av.verifier): online "
    "acceptance estimator + survival + budget. Owns the estimator (warm start from "
    "snapshot_path) and exports the av_* metrics. EstimatorConfig fields are parameters too "
    "(avspec.config.EstimatorConfig).",
    "model_repository/verifier/configs/gpu.pbtxt": "GPU variant of the adaptive verifier, "
    f"{GPU_VARIANT} Same tensors and estimator parameters as ../config.pbtxt; features arrive "
    "and num_verify leaves as device tensors (model_gpu.py); seq ids and bookkeeping stay on "
    "the host.",
    "model_repository/target/config.pbtxt": "Target stage (avspec.engine.target_stage): CPU "
    "stand-in for the TensorRT-LLM engine that verifies num_verify drafts per sequence with "
    "lossless rejection sampling. Contract: docs/architecture.md.",
    "model_repository_gpu/trtllm_target/config.pbtxt": f"{TEMPLATE}\nThe target stage of the GPU "
    "step ensemble (model_repository/speculative_step/configs/gpu.pbtxt): the same tensors as "
    "the CPU `target`, answered by fanning the step out to one tensorrt_llm request per "
    "sequence (draft_input_ids = its num_verify admitted drafts, draft_logits = log q) and "
    "gathering the answers back into output_ids / num_accepted (avspec.trtllm.request).",
    "model_repository_gpu/tensorrt_llm/config.pbtxt": f"{TEMPLATE}\nThe TensorRT-LLM target "
    "engine behind the tensorrtllm backend, built with "
    "--speculative_decoding_mode=draft_tokens_external (and --gather_generation_logits for "
    "draft_logits). trtllm_target sends one request per sequence per step; the backend's batch "
    "manager batches them in flight. Only the tensors trtllm_target uses are declared "
    "(avspec.trtllm.request.TRTLLM_INPUTS / TRTLLM_OUTPUTS). The backend places the engine on "
    "the GPUs itself; the Triton instance is a CPU-side handle.",
}

# By name, or "model.name" for one model's own meaning.
PARAMETER_NOTES: dict[str, str] = {
    # draft and target (avspec.serving.repository.StageParams)
    "model_dir": "Hugging Face checkpoint directory, relative to the project root or absolute",
    "max_draft_tokens": "K; equal to the verifier's num_positions and the entry's",
    "max_sequences": "KV cache slots",
    "max_length": "KV cache positions per sequence",
    "idle_timeout_s": "free a sequence not stepped for this long (none: never)",
    "device": "torch device",
    "malloc_trim_steps": "give freed heap back to the OS every N steps (0: off)",
    "malloc_mmap_mib": "this stage's glibc mmap threshold in MiB (0: the environment's)",
    "dtype": "serving precision of weights and KV cache (avspec.runtime.precision)",
    "vocab_limit": "logits past this many tokens set to -inf (0: none)",
    "draft_top_k": "draft from the top k tokens within top-p (0: the target's warp)",
    "draft_vocab": "reduced draft vocabulary map (auto: model_dir's draft_vocab.json if any)",
    "engine": "runtime: torch, llamacpp or auto (avspec.runtime.engine_choice)",
    "gguf": "llamacpp: the GGUF file, relative to model_dir or absolute",
    "threads": "llamacpp: threads per stage (0: every core)",
    "kv_pool_tokens": "KV cells shared by the stage's sequences (0: sequences x length)",
    "flash_attention": "llamacpp: ggml's flash attention (false: the slower plain path)",
    "emit_features": "also return the target's features for a draft head (the launcher sets it)",
    # verifier (avspec.config.EstimatorConfig, avspec.serving.repository.VerifierParams)
    "num_positions": "K, draft positions with their own intercept",
    "initial_slope": "starting slope (the default pair's fit; a snapshot replaces it)",
    "initial_intercept": "starting intercepts (the default pair's fit)",
    "refit_interval": "decode steps between Newton refits",
    "ridge": "ridge penalty of the refit",
    "damping": "evidence damping: a refit step scaled by n / (n + damping)",
    "cost_tables": "step-cost file; host: this host's, measured by the launcher",
    "snapshot_path": "warm start file (empty: none)",
    "adaptive_drafting": "hand the draft a plan each step (entry: the request default)",
    "cost_refresh": "refresh the cost tables online from measured stage times",
    "cost_refresh_window": "steps of measurements the refresh keeps",
    "cost_refresh_every": "steps between refreshes",
    "pair_id": "identity of the served draft/target pair (warm start; empty: unknown)",
    "step_log": "JSON lines of each step's features and choice, for replays (empty: off)",
    # speculative (avspec.serving.repository.EntryParams)
    "max_batch_size": "live sequences stepped together; more wait in a queue",
    "max_context": "prompt + max_tokens + K must fit",
    "adaptive_verification": "default when a request does not say",
    "step_model": "the model called once per decode step",
    "max_queued": "requests waiting beyond free batch slots, all clients (none: unbounded)",
    "max_queued_per_client": "the same for one client (none: unbounded)",
    "refit_max_temperature": "outcomes of hotter requests do not feed the refit",
    "refit_client_share": "one client labels at most max(1, floor(s n)) of a step's n rows",
    "request_timeout_s": "wall-clock limit per request from submission (0: none)",
    "prefill_chunk": "prompt tokens a sequence sends per step while prefilling (0: all)",
    # trtllm_target (avspec.serving.repository.TrtllmTargetParams)
    "trtllm_model": "the tensorrtllm-backend model called once per sequence",
    "trtllm_target.max_draft_tokens": "K: must equal the draft's max_draft_tokens and be <= "
    "the engine's --max_draft_len",
    "speculative.max_draft_tokens": "K, the largest num_draft_tokens a request may ask for",
    "vocab_size": "the engine's vocabulary (draft_logits width)",
    "use_draft_logits": "send draft_logits (probabilistic acceptance) when sampling",
    # tensorrt_llm (the tensorrtllm backend's own parameters)
    "gpt_model_type": "the backend's batching mode",
    "gpt_model_path": "the TensorRT-LLM engine directory",
    "max_beam_width": "beams per request",
    "batch_scheduler_policy": "the batch manager's scheduling policy",
    "kv_cache_free_gpu_mem_fraction": "share of free GPU memory for the KV cache",
    "enable_kv_cache_reuse": "each step resends the whole context: block reuse makes it a hit",
    "exclude_input_in_output": "trtllm_target parses generated tokens only",
    # the Python backend
    "FORCE_CPU_ONLY_INPUT_TENSORS": "no: input tensors stay on the device they arrive on",
}
