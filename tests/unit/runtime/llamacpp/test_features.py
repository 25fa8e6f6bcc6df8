"""A draft head over a target on llama.cpp's engine: the target's features from ggml.

A tiny Llama written as an f32 GGUF is loaded twice, by llama.cpp's engine with
`EngineSettings.features` and by the torch runtime (the same file converted):

- `features()` equals the torch runtime's final-norm output of the last block at every packed
  token of a ragged batch, also when the batch is split across decodes (tolerance 1e-2: ggml
  keeps its KV cache in float16; the deliberate fault, the output before the final norm, lies
  more than 10x past it);
- the logits asked for with `at` are the same rows as without features;
- the target stage on the engine emits them, and greedy generation with a head drafting from
  them equals the engine's greedy output without drafts, with drafts accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.generation import generate
from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf

from avspec.av.step_cost import StepCost
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.gguf.convert import convert_gguf
from avspec.runtime.head import new_head
from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel
from avspec.runtime.model_dir import load_model
from avspec.runtime.transformer import Transformer

TOLERANCE = 1e-2  # measured 2.3e-3: ggml keeps the KV cache in float16
K, EOS = 3, 0
PROMPTS = [[72, 101, 108, 108, 111], [40, 41, 42], [200, 3, 17, 99, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def tiny(binding, tmp_path_factory) -> tuple[Path, Transformer]:
    """(the GGUF, the same weights on the torch runtime in float32): one layer, so a head
    started from it nearly is the target."""
    root = tmp_path_factory.mktemp("features")
    shape = TinyLlama(layers=1)
    path = write_llama_gguf(root / "tiny.gguf", shape, llama_weights(shape, seed=5))
    converted = convert_gguf(path, root / "hf", dtype=torch.float32, progress=False)
    return path, load_model(converted, dtype=torch.float32)


def engine(path: Path, features: bool = True, batch_tokens: int = 512) -> GGUFModel:
    settings = EngineSettings(max_sequences=8, pool_tokens=512, max_outputs=32, threads=1,
                              batch_tokens=batch_tokens, features=features)  # fmt: skip
    return GGUFModel(path, settings)


@torch.no_grad()
def torch_features(model: Transformer, prompt: list[int], norm: bool = True) -> torch.Tensor:
    x = model.embed(torch.tensor([prompt]))
    for block in model.blocks:
        x = block(x, model.rotary)
    return (model.final_norm(x) if norm else x)[0]


@pytest.mark.parametrize("batch_tokens", [512, 5], ids=["one-decode", "split"])
def test_features_are_the_final_norm_output(tiny, batch_tokens: int) -> None:
    path, reference = tiny
    model = engine(path, batch_tokens=batch_tokens)
    pool = model.new_cache(max_length=32)
    pool.allocate(0), pool.allocate(1)
    a, b = PROMPTS[0], PROMPTS[2]
    model.forward_cached(pool, [0, 1], torch.tensor(a + b), [len(a), len(b)])
    got = model.features().clone()
    want = torch.cat([torch_features(reference, a), torch_features(reference, b)])
    assert got.shape == (len(a) + len(b), model.width)
    assert (got - want).abs().max() <= TOLERANCE
    unnormed = torch.cat([torch_features(reference, p, norm=False) for p in (a, b)])
    fault = (got - unnormed).abs().max()
    assert fault > 10 * TOLERANCE, f"the fault this test would catch moves them by {fault}"


def test_logits_at_are_the_same_rows_with_features(tiny) -> None:
    path, _ = tiny
    rows = []
    for features in (True, False):
        model = engine(path, features=features)
        pool = model.new_cache(max_length=32)
        pool.allocate(0)
        prompt = PROMPTS[2]
        at = torch.tensor([2, len(prompt) - 1])
        rows.append(model.forward_cached(pool, [0], torch.tensor(prompt), [len(prompt)], at=at))
        rows[-1] = rows[-1].clone()
    assert rows[0].shape == rows[1].shape == (2, rows[0].shape[1])
    assert (rows[0] - rows[1]).abs().max() <= TOLERANCE


def test_features_need_the_setting(tiny) -> None:
    with pytest.raises(ValueError, match="EngineSettings.features"):
        engine(tiny[0], features=False).features()


def test_greedy_with_a_head_over_the_engine_equals_the_engine_alone(tiny) -> None:
    path, reference = tiny
    head = new_head(reference, init_layer=0).eval()
    step = SpeculativeStep.from_models(
        engine(path), head, StepCapacity(K, 8, 64),
        cost=StepCost.linear(0.1, 0.01, 1.0, 0.2, max_rows=64, max_tokens=512),
    )  # fmt: skip
    assert step.target.emit_features
    scheduler = Scheduler(step, EOS, 8, 64, K)

    def run(drafts: int) -> list[list[int]]:
        requests = [GenerationRequest(p, 16, temperature=0.0, num_draft_tokens=drafts)
                    for p in PROMPTS]  # fmt: skip
        return generate(scheduler, requests)

    alone = run(0)
    before = scheduler.counters.accepted
    assert run(K) == alone
    assert scheduler.counters.accepted - before > 0, "the head's drafts were never accepted"
