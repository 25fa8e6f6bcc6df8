"""`avspec.tools.train.draft.generate.answer_all`: continuous batching over the runtime's KV cache.

With temperature 0 (greedy) every answer must equal a dense greedy recomputation of that prompt
alone, whatever the batch size (slots are reused as answers finish, prefills join running
decodes), and the saved top-k logits must be the dense model's at each answer position. A cache
that mixed up slots, or a prefill that read the wrong last position, would change both.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_dirs import spread_weights

from avspec.runtime.transformer import Transformer, TransformerConfig
from avspec.tools.train.draft.generate import answer_all

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
    results = answer_all(
        model, PROMPTS, EOS, batch=batch, max_new_tokens=9, temperature=0.0, top_p=1.0, keep=5,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    for prompt, result in zip(PROMPTS, results, strict=True):
        answer, logits = _dense_greedy(model, prompt, 9)
        assert result["answer"].tolist() == answer
        values, ids = logits.topk(5, dim=-1)
        assert torch.equal(result["top_ids"], ids.to(torch.int32))
        assert torch.allclose(result["top_logits"].float(), values, atol=2e-2, rtol=1e-2)
