"""`avspec.tools.draft.train` and `model`: the distillation loss, the answer positions it scores,
the embedding taken from the target, and the prompts it trains on."""

from __future__ import annotations

import torch

from avspec.runtime.transformer import Transformer, TransformerConfig
from avspec.tools.draft.model import svd_embedding
from avspec.tools.draft.prompts import KINDS, build_prompts
from avspec.tools.draft.train import answer_logits, top_kl
from avspec.tools.training.corpus import TOPICS_PREFIX

CONFIG = TransformerConfig(
    num_layers=1, width=32, num_heads=2, vocab_size=40, max_length=64, mlp="swiglu", norm_eps=1e-5
)


def test_top_kl_is_zero_only_for_the_teacher():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 40, generator=gen) * 3
    values, ids = teacher.topk(8, dim=-1)
    exact = torch.full_like(teacher, -1e9).scatter(-1, ids, values)
    assert top_kl(exact, ids, values).abs() < 1e-5
    assert top_kl(teacher, ids, values) > 1e-3  # mass outside the top 8 is penalised
    assert top_kl(torch.randn(6, 40, generator=gen), ids, values) > 0.1


def test_answer_logits_are_the_dense_logits_at_answer_positions():
    model = Transformer(CONFIG).eval()
    seqs = [
        {"ids": torch.tensor([1, 2, 3, 4, 5]), "prompt_length": 3, "answer_length": 3},
        {"ids": torch.tensor([6, 7, 8]), "prompt_length": 2, "answer_length": 2},
    ]
    with torch.no_grad():
        logits, _ = answer_logits(model, seqs)
        dense = [model(s["ids"][None])[0] for s in seqs]
    expected = torch.cat([dense[0][2:5], dense[1][1:3]])
    assert torch.allclose(logits, expected, atol=1e-5)


def test_svd_embedding_keeps_inner_products():
    target = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    full = svd_embedding(target, 16)
    assert torch.allclose(full @ full.T, target @ target.T, atol=1e-3)
    part = svd_embedding(target, 4)
    assert part.shape == (40, 4)
    # the best rank-4 approximation of the Gram matrix: better than any 4 raw columns
    err_svd = (part @ part.T - target @ target.T).norm()
    err_cols = (target[:, :4] @ target[:, :4].T - target @ target.T).norm()
    assert err_svd < err_cols


def test_prompts_cycle_kinds_and_are_reproducible():
    code = "def add(a, b):\n    '''Add two numbers and return their sum.'''\n    return a + b\n"
    prose = (
        "The while statement\n\nThe while statement is used for repeated execution as long as an "
        "expression is true. It tests the expression and, if it is true, executes the first "
        "suite; if the expression is false the loop terminates and the else clause runs.\n"
    )
    files = [("m.py", code), (TOPICS_PREFIX + "while", prose)]
    prompts = build_prompts(files, 12, seed=3)
    assert [p.kind for p in prompts] == list(KINDS) * 2
    assert prompts == build_prompts(files, 12, seed=3)
    assert "Write a Python function `add`: Add two numbers" in prompts[1].message
    assert all(p.source in {"m.py", TOPICS_PREFIX + "while"} for p in prompts)
