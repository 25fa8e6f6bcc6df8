"""The modelled GPU step cost: a roofline per forward, exact in its tables."""

from __future__ import annotations

import pytest

from avspec.tools.bench.gpu_cost import (
    H100_SXM,
    LLAMA_1B,
    LLAMA_8B,
    forward_ms,
    gpu_step_cost,
    knee_tokens,
    kv_ms,
)


def test_an_8b_decode_step_streams_its_weights() -> None:
    # 16.06 GB at 0.8 x 3.35 TB/s = 5.99 ms, plus the 0.3 ms launch: about 160 tokens/s
    assert forward_ms(LLAMA_8B, H100_SXM, 1) == pytest.approx(6.29, abs=0.01)
    assert forward_ms(LLAMA_8B, H100_SXM, 64) == forward_ms(LLAMA_8B, H100_SXM, 1)
    knee = knee_tokens(LLAMA_8B, H100_SXM)
    assert 200 < knee < 240  # bf16 H100: weight-bound until about 220 tokens
    past = forward_ms(LLAMA_8B, H100_SXM, 2 * int(knee))
    assert past == pytest.approx(0.3 + 2 * (forward_ms(LLAMA_8B, H100_SXM, 1) - 0.3), rel=0.01)


def test_kv_reads_scale_with_rows_and_context() -> None:
    assert kv_ms(LLAMA_8B, H100_SXM, 1, 0) == 0.0
    one = kv_ms(LLAMA_8B, H100_SXM, 1, 512)
    assert one == pytest.approx(512 * 131072 / (3350e6 * 0.8))
    assert kv_ms(LLAMA_8B, H100_SXM, 64, 512) == pytest.approx(64 * one)


@pytest.mark.parametrize("tokens", [1, 3, 9, 100, 221, 222, 300, 576, 1000, 7000])
def test_the_tables_match_the_formula_between_and_past_their_sizes(tokens: int) -> None:
    cost = gpu_step_cost(context=256, overhead_ms=1.5)
    assert cost.verify.at(tokens) == pytest.approx(forward_ms(LLAMA_8B, H100_SXM, tokens))
    rows = min(tokens, 64)
    expected = forward_ms(LLAMA_1B, H100_SXM, rows) + kv_ms(LLAMA_1B, H100_SXM, rows, 256)
    assert cost.draft_pass.at(rows) == pytest.approx(expected)
    assert cost.verify_row_ms == pytest.approx(kv_ms(LLAMA_8B, H100_SXM, 1, 256))
    assert cost.overhead_ms == 1.5


def test_speculation_is_nearly_free_at_one_row_and_dear_at_sixty_four() -> None:
    cost = gpu_step_cost()
    assert cost.verify_ms(9, 1) / cost.verify_ms(1, 1) < 1.01
    assert cost.verify_ms(64 * 9, 64) / cost.verify_ms(64, 64) > 2.0


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="context"):
        gpu_step_cost(context=-1)
