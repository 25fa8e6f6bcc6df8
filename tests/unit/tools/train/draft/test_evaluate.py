"""`avspec.tools.train.draft.evaluate`: `soft_auc`, the AUC of a score against accept/reject
outcomes drawn with the given acceptance probabilities; `served_draft`, a draft as its map serves
it."""

from __future__ import annotations

import torch

from avspec.engine.draft_vocab import DraftVocab
from avspec.runtime.transformer import Transformer, TransformerConfig
from avspec.tools.train.draft.evaluate import served_draft, soft_auc
from avspec.tools.train.tiny.evaluate import warp


def test_matches_the_sampled_auc():
    gen = torch.Generator().manual_seed(0)
    score = torch.randn(3000, generator=gen)
    accept = torch.sigmoid(1.5 * score)
    outcome = torch.bernoulli(accept, generator=gen).bool()
    sampled = (score[outcome][:, None] > score[~outcome][None, :]).double().mean()
    assert abs(soft_auc(score, accept) - float(sampled)) < 0.02
    assert abs(soft_auc(-score, accept) - (1 - float(sampled))) < 0.02


def test_ties_and_extremes():
    assert soft_auc(torch.zeros(7), torch.rand(7)) == 0.5
    assert soft_auc(torch.arange(4.0), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 1.0
    assert soft_auc(torch.arange(4.0), torch.tensor([1.0, 1.0, 0.0, 0.0])) == 0.0


def test_the_served_draft_proposes_only_its_kept_ids():
    config = TransformerConfig(
        num_layers=1, width=32, num_heads=2, vocab_size=40, max_length=64, mlp="swiglu"
    )
    draft = Transformer(config).eval()
    assert served_draft(draft, None) is draft
    vocab = DraftVocab.of([0, 3, 5, 39], 40)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        full, served = draft(ids), served_draft(draft, vocab)(ids)
    kept = list(vocab.token_ids)
    assert torch.equal(served[..., kept], full[..., kept])
    outside = torch.ones(40, dtype=torch.bool)
    outside[kept] = False
    assert torch.isneginf(served[..., outside]).all()
    q = warp(served[0, -1:], 0.7, 0.95)
    assert q[0, outside].sum() == 0 and abs(float(q.sum()) - 1) < 1e-5
