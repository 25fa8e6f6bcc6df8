"""Training loop: the learning-rate schedule, and a seeded run that lowers the loss."""

from __future__ import annotations

import pytest
import torch

from avspec.runtime.transformer import TransformerConfig
from avspec.tools.train.tiny.train import TrainSettings, lr_at, train_model

TINY = TransformerConfig(num_layers=1, width=16, num_heads=2, max_length=64)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    settings = TrainSettings(steps=1000, lr=1e-3, warmup=100)
    assert lr_at(0, settings) == pytest.approx(1e-5)
    assert lr_at(99, settings) == pytest.approx(1e-3)
    assert lr_at(100, settings) == pytest.approx(1e-3)
    assert lr_at(1000, settings) == pytest.approx(1e-4)
    assert lr_at(550, settings) == pytest.approx(5.5e-4)


@pytest.fixture()
def one_thread():
    """Tiny models run faster on one thread, and the machine is shared with training.

    Not the shared `single_thread` fixture: that one turns gradients off, and this test trains.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_train_model_is_seeded_and_lowers_the_loss(one_thread):
    data = torch.tensor(list(b"abcabcabd" * 60), dtype=torch.int64)
    settings = TrainSettings(steps=15, batch=4, seq=16, lr=3e-2, warmup=3)
    a, log = train_model(TINY, settings, data, data, seed=1, label="test")
    b, _ = train_model(TINY, settings, data, data, seed=1, label="test")
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [entry["step"] for entry in log] == [15]
    assert log[0]["held_out_bpb"] < 3.0  # from 8 bits (uniform) on a 3-letter pattern
