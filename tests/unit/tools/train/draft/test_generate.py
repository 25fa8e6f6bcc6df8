"""`avspec.tools.train.draft.generate.answer_all`: continuous batching over the runtime's KV cache.

With temperature 0 (greedy) every answer must equal a dense greedy recomputation of that prompt
alone, whatever the batch size (slots are reused as answers finish, prefills join running
decodes), and the saved top-k logits must be the dense model's at each answer position. A cache
that mixed up slots, or a prefill that read the wrong last position, would change both. With
`features`, the answers are the same and each sequence's features are the target's normed last
hidden state at every position it read (prompt, then answer but its last token), equal to one
prefill of that sequence alone: a row shifted by one position fails.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_dirs import spread_weights

from avspec.runtime.transformer import Transformer, TransformerConfig
from avspec.tools.train.draft.generate import AnswerSettings, answer_all

CONFIG = TransformerConfig(
    num_layers=2, width=32, num_heads=4, num_kv_heads=2, vocab_size=50, max_length=600,
    mlp="swiglu", norm_eps=1e-5,
)  # fmt: skip
EOS = frozenset({7})
PROMPTS = [[1, 2, 3], [4, 5, 6, 8, 9, 10, 11], [12], [13, 14, 15, 16], [17, 18], [20, 21, 22]]


def _dense_greedy(model: Transformer, prompt: list[int], max_new: int) -> tuple[list, torch.Tensor]:
    ids, logits = list(prompt), []
    for _ in range(max_new):
        last = model(torch.tensor([ids]))[0, -1]
        logits.append(last)
        ids.append(int(last.argmax()))
        if ids[-1] in EOS:
            break
    return ids[len(prompt) :], torch.stack(logits)


@pytest.mark.parametrize("batch", [1, 2, 4])
@torch.no_grad()
def test_greedy_answers_equal_dense_decoding(batch):
    model = spread_weights(Transformer(CONFIG), seed=3)
    settings = AnswerSettings(batch, max_new_tokens=9, temperature=0.0, top_p=1.0, keep=5)
    results = answer_all(model, PROMPTS, EOS, settings, torch.Generator().manual_seed(0))
    for prompt, result in zip(PROMPTS, results, strict=True):
        answer, logits = _dense_greedy(model, prompt, 9)
        assert result["answer"].tolist() == answer
        values, ids = logits.topk(5, dim=-1)
        assert torch.equal(result["top_ids"], ids.to(torch.int32))
        assert torch.allclose(result["top_logits"].float(), values, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_features_are_the_targets_normed_hidden_states_at_every_read_position(batch):
    model = spread_weights(Transformer(CONFIG), seed=3)
    settings = AnswerSettings(batch, max_new_tokens=9, temperature=0.0, top_p=1.0, keep=5)
    plain = answer_all(model, PROMPTS, EOS, settings, torch.Generator().manual_seed(0))
    with_features = AnswerSettings(batch, 9, 0.0, 1.0, keep=5, features=True)
    results = answer_all(model, PROMPTS, EOS, with_features, torch.Generator().manual_seed(0))
    for prompt, result, reference in zip(PROMPTS, results, plain, strict=True):
        assert torch.equal(result["answer"], reference["answer"])
        ids = prompt + result["answer"].tolist()[:-1]
        assert result["features"].shape == (len(ids), CONFIG.width)
        assert result["features"].dtype == torch.float16
        cache = model.new_cache(1, 64)
        cache.allocate(0)
        hidden = model.forward_cached(cache, [0], torch.tensor(ids), [len(ids)], hidden=True)
        expected = model.final_norm(hidden)
        assert torch.allclose(result["features"].float(), expected, atol=2e-2, rtol=1e-2)
