"""avspec.tools.bench.soak.mix: the request mix and the prompts that fit."""

from __future__ import annotations

import json
import random
from pathlib import Path

from avspec.tools.bench.soak.mix import PROTOCOLS, STREAMING, Mix, draw_request, load_prompts


def test_draw_request_mix():
    mix = Mix(["a", "b"], 16, 64, cancel_fraction=0.5)
    rng = random.Random(1)
    specs = [draw_request(rng, mix) for _ in range(2000)]
    assert {s.protocol for s in specs} == set(PROTOCOLS)
    assert {s.temperature for s in specs} == {0.0, 0.7, 1.0}
    assert {s.num_draft_tokens for s in specs} == {0, 4, None}
    assert min(s.max_tokens for s in specs) == 16 and max(s.max_tokens for s in specs) == 64
    cancelled = [s for s in specs if s.cancel_after is not None]
    assert cancelled and {s.protocol for s in cancelled} == set(STREAMING)
    assert {s.cancel_after for s in cancelled} == {1, 2, 3}
    grpc_share = sum(s.protocol == "grpc" for s in specs) / len(specs)
    assert 0.45 < grpc_share < 0.55


def test_draw_request_is_repeatable_from_the_seed():
    mix = Mix(["a", "b", "c"])
    first = [draw_request(random.Random(7), mix) for _ in range(3)]
    assert first == [draw_request(random.Random(7), mix) for _ in range(3)]


def test_no_cancel_without_a_cancel_fraction():
    mix = Mix(["a"], cancel_fraction=0.0)
    rng = random.Random(0)
    assert all(draw_request(rng, mix).cancel_after is None for _ in range(500))


def test_load_prompts_skips_what_does_not_fit(tmp_path: Path):
    lines = [json.dumps({"prompt": p}) for p in ("abc", "x" * 10, "é" * 4, "")]  # é: 2 bytes
    (tmp_path / "w.jsonl").write_text("\n".join(lines) + "\n\n")
    (tmp_path / "other.txt").write_text("ignored")
    assert load_prompts(tmp_path, 8) == ["abc", "é" * 4]
