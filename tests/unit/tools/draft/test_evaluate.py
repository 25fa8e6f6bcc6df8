"""`avspec.tools.draft.evaluate.soft_auc`: the AUC of a score against accept/reject outcomes
drawn with the given acceptance probabilities."""

from __future__ import annotations

import torch

from avspec.tools.draft.evaluate import soft_auc


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
