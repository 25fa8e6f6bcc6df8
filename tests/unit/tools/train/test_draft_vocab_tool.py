"""`python -m avspec.tools.train.draft_vocab`: the map of the most frequent answer ids, the special
and chat-template ids always kept, the coverage figures, and a file the draft stage loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.server import save_tiny_pair

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.model_dir import load_tokenizer
from avspec.tools.train import draft_vocab as tool

pytestmark = pytest.mark.usefixtures("single_thread")

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory, _ = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def save_chunk(directory: Path, answers: list[list[int]], prompts: list[list[int]]) -> None:
    """A chunk file as the draft's data phase writes it (top-64 logits: answer id first)."""
    directory.mkdir(parents=True, exist_ok=True)
    top_ids, top_logits = [], []
    for answer in answers:
        ids = torch.arange(64)[None].repeat(len(answer), 1)
        ids[:, 0] = torch.tensor(answer)
        ids[:, 1:] = torch.where(ids[:, 1:] == ids[:, :1], 200, ids[:, 1:] + 100)
        logits = torch.full((len(answer), 64), -10.0)
        logits[:, 0] = 10.0  # the target is sure of the answer token
        top_ids.append(ids.int())
        top_logits.append(logits.half())
    torch.save(
        {"kinds": ["test"] * len(answers), "prompt": [torch.tensor(p) for p in prompts],
         "answer": [torch.tensor(a) for a in answers], "top_ids": top_ids,
         "top_logits": top_logits},
        directory / "chunk_00000.pt",
    )  # fmt: skip


def test_always_kept_are_the_special_and_template_ids(target: Path) -> None:
    tokenizer = load_tokenizer(target)
    kept = tool.always_kept(target)
    assert set(tokenizer.eos_ids) <= set(kept)
    for role in ("system", "user", "assistant"):
        assert set(tokenizer.encode(f"[{role}]")) <= set(kept)
    assert kept == sorted(set(kept))


def test_counts_and_choice_prefer_frequent_ids_then_lower_ids() -> None:
    seqs = [{"answer": torch.tensor([5, 5, 7, 300]), "ids": torch.tensor([9, 9, 5, 5, 7]),
             "prompt_length": 2}]  # fmt: skip
    counts = tool.count_tokens(seqs, 257)
    assert counts[5] == 2 and counts[7] == 1 and counts[9] == 0 and counts.sum() == 3
    assert tool.count_tokens(seqs, 257, prompts=True)[9] == 2
    assert tool.choose(counts, 4, [0]) == [0, 1, 5, 7]  # 0 kept, 5 and 7 counted, then id 1
    assert tool.choose(counts, 1, [0, 3]) == [0, 3]  # never fewer than the kept ones


def test_ids_never_written_rank_by_the_targets_mass() -> None:
    """Equal counts (none) are broken by the target's top-64 mass, then by the lower id."""
    counts = torch.zeros(257, dtype=torch.int64)
    counts[7] = 1
    mass = torch.zeros(257, dtype=torch.float64)
    mass[200], mass[100] = 0.5, 0.2
    assert tool.choose(counts, 4, [0], mass) == [0, 7, 100, 200]  # 7 counted, then by mass
    assert tool.choose(counts, 5, [0], mass) == [0, 1, 7, 100, 200]  # then the lower id
    seqs = [{"top_ids": torch.tensor([[3, 4]]), "top_logits": torch.tensor([[0.0, -50.0]])}]
    assert tool.teacher_mass(seqs, 257)[3] == pytest.approx(1.0)  # 4 is past top-p 0.95


def test_tool_writes_a_map_the_stage_loads(target: Path, tmp_path: Path) -> None:
    answers = [[40, 40, 41, 42], [40, 43, 44]]
    save_chunk(tmp_path / "train", answers, [[60, 61], [62]])
    save_chunk(tmp_path / "heldout", [[40, 41, 99]], [[60]])
    out = tmp_path / "draft_vocab.json"
    special = tool.always_kept(target)
    size = len(special) + 3
    args = ["--target", str(target), "--chunks", str(tmp_path / "train"), "--heldout",
            str(tmp_path / "heldout"), "--size", str(size), "--out", str(out)]  # fmt: skip
    assert tool.main(args) == 0
    vocab = load_draft_vocab(out, 257)
    data = json.loads(out.read_text())
    assert len(vocab) == size and set(special) <= set(vocab.token_ids)
    assert {40, 41, 42} <= set(vocab.token_ids) and 99 not in vocab.token_ids
    assert data["vocab_size"] == 257 and "most frequent ids" in vocab.source
    coverage = data["coverage"]
    assert coverage["train_answer_tokens"] == pytest.approx(5 / 7, abs=1e-4)  # 43, 44 left out
    assert coverage["heldout_answer_tokens"] == pytest.approx(2 / 3, abs=1e-4)
    assert coverage["heldout_target_mass"] == pytest.approx(2 / 3, abs=1e-3)
    with pytest.raises(SystemExit, match="--size must lie in 1..257"):
        tool.main([*args[:-4], "--size", "300", "--out", str(out)])
