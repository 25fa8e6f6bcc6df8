"""The layers of avspec, bottom to top: the one place they are listed.

Each entry names top-level modules and subpackages of avspec; a subpackage's modules (its
sub-subpackages included) belong to its layer. The rule, checked by tests/unit/test_layers.py on
every import statement of the package (top-level, function-local and `if TYPE_CHECKING:` ones
alike, relative imports resolved):

- a module may import from its own layer and from layers below it, never from a layer above;
- modules of one layer (one subpackage, or two entries of one layer such as serving and trtllm)
  may import each other, but no chain of imports may come back to where it started: no import
  cycle anywhere in the package, within a layer or across layers;
- every top-level module and subpackage of avspec is listed here exactly once, so a new one has
  to be given its place; `avspec/__init__.py` itself runs before any avspec module and so sits in
  the bottom layer (it imports nothing of avspec).

What each layer holds:

- checks, config, layers: shape and value checks, the validated configuration, this list;
- contract: the step contract (StepInputs, StepOutputs, the host view, base_tokens);
- runtime: transformer, KV cache, tokenizer, model directories;
- av: the adaptive-verification algorithm (features, estimator, refit, survival, budget, cost
  tables, verifier, snapshot, calibration);
- engine: sequence slots, draft and target stages, sampling, rejection, the step, the scheduler;
- serving, trtllm: the Triton launcher, repository and model helpers; the TensorRT-LLM path;
- tools: training, workloads, profiling and benchmark statistics, outside the served path.

docs/architecture.md draws these layers; this tuple is the source it follows.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    ("checks", "config", "layers"),
    ("contract",),
    ("runtime",),
    ("av",),
    ("engine",),
    ("serving", "trtllm"),
    ("tools",),
)

# Inside serving, one part per program a module runs in, and the parts each must not import
# (tests/unit/serving/test_layers.py). The modules at serving's top (repository, exposure) are
# shared by all three and import none of them.
SERVING_PARTS: dict[str, tuple[str, ...]] = {
    "stages": ("host", "front"),  # inside Triton's Python-backend stubs
    "front": ("stages", "host"),  # the public HTTP, gRPC and metrics door
    "host": ("stages",),  # starts, sandboxes and guards tritonserver, and starts the front
}
