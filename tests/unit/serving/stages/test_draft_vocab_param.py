"""The draft model's `draft_vocab` parameter: off by default in StageParams, `auto` (the draft's
own map when it has one) in the served CPU repository, a map file in the draft's model directory
(or an absolute path) when set, refused on the target, errors naming the file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers.server import save_tiny_pair

from avspec.engine.draft_vocab import (
    DRAFT_VOCAB_AUTO,
    DRAFT_VOCAB_FILE,
    DraftVocabError,
    save_draft_vocab,
)
from avspec.serving.repository import (
    STEP_INPUT_DTYPES,
    TORCH_DTYPES,
    StageParams,
    read_config_parameters,
)
from avspec.serving.stages.adapters import DraftAdapter, TargetAdapter

pytestmark = pytest.mark.usefixtures("single_thread")

K = 4
KEPT = list(range(32, 127))  # printable ASCII bytes of the byte-level tiny pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    save_draft_vocab(draft / DRAFT_VOCAB_FILE, KEPT, "unit test")
    return target, draft


def params(model_dir: Path, **kw: object) -> StageParams:
    return StageParams(model_dir=str(model_dir), max_draft_tokens=K, max_sequences=4,
                       max_length=64, **kw)  # fmt: skip


def first_step(batch: int = 2) -> dict[str, torch.Tensor]:
    tensors = {
        name: torch.zeros(batch, dtype=TORCH_DTYPES[dtype])
        for name, dtype in STEP_INPUT_DTYPES.items()
    }
    tensors["seq_ids"] = torch.arange(1, batch + 1)
    tensors["input_ids"] = torch.full((batch, 3), 65, dtype=torch.int32)
    tensors["input_lengths"][:] = 3
    tensors["num_draft_tokens"][:] = K
    tensors["temperature"][:] = 1.0
    tensors["top_p"][:] = 1.0
    tensors["prev_num_accepted"] = torch.zeros(0, dtype=torch.int32)
    tensors["draft_plan"] = torch.zeros(0)
    tensors["prev_timing_ms"] = torch.zeros(0)
    tensors["prev_target_features"] = torch.zeros(0, 0)
    tensors["prev_feature_counts"] = torch.zeros(0, dtype=torch.int32)
    tensors["prev_feature_starts"] = torch.zeros(0, dtype=torch.int32)
    return tensors


def test_default_is_off(pair: tuple[Path, Path], tmp_path: Path) -> None:
    assert StageParams(model_dir="x").draft_vocab == ""
    assert DraftAdapter(params(pair[1]), tmp_path).stage.head is None


@pytest.mark.parametrize("absolute", [False, True], ids=["in-model-dir", "absolute"])
def test_the_map_reaches_the_draft(pair: tuple[Path, Path], tmp_path: Path, absolute: bool) -> None:
    name = str(pair[1] / DRAFT_VOCAB_FILE) if absolute else DRAFT_VOCAB_FILE
    adapter = DraftAdapter(params(pair[1], draft_vocab=name), tmp_path)
    assert adapter.stage.head is not None and len(adapter.stage.head) == len(KEPT)
    drafted = adapter(first_step())
    outside = torch.ones(drafted["draft_probs"].shape[-1], dtype=torch.bool)
    outside[KEPT] = False
    assert torch.all(drafted["draft_probs"][..., outside] == 0)
    torch.testing.assert_close(drafted["draft_probs"].sum(-1), torch.ones(2, K))
    assert all(32 <= t < 127 for t in drafted["draft_tokens"].flatten().tolist())


def test_auto_takes_the_drafts_own_map_when_it_has_one(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """`auto` (the served default): the draft directory's draft_vocab.json, else no map."""
    with_map = DraftAdapter(params(pair[1], draft_vocab=DRAFT_VOCAB_AUTO), tmp_path)
    assert with_map.stage.head is not None and len(with_map.stage.head) == len(KEPT)
    bare = save_tiny_pair(tmp_path / "bare")[1]
    assert DraftAdapter(params(bare, draft_vocab=DRAFT_VOCAB_AUTO), tmp_path).stage.head is None


def test_the_served_configs_take_the_drafts_own_map() -> None:
    """The repository serves `auto`, on the CPU and (not yet run there) on a GPU."""
    from helpers import ROOT

    for config in ("config.pbtxt", "configs/gpu.pbtxt"):
        text = (ROOT / "model_repository" / "draft" / config).read_text()
        assert read_config_parameters(text)["draft_vocab"] == "auto", config


def test_the_map_is_refused_on_the_target_and_when_missing(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="draft_vocab is a parameter of the draft model only"):
        TargetAdapter(params(pair[0], draft_vocab=DRAFT_VOCAB_FILE), tmp_path)
    with pytest.raises(DraftVocabError, match="no such file") as err:
        DraftAdapter(params(pair[1], draft_vocab="absent.json"), tmp_path)
    assert str(pair[1] / "absent.json") in str(err.value)


def test_a_map_past_the_vocab_limit_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    base = params(pair[1], draft_vocab=DRAFT_VOCAB_FILE)
    with pytest.raises(DraftVocabError, match=r"= 100 is outside the vocabulary 0..99"):
        DraftAdapter(dataclasses.replace(base, vocab_limit=100), tmp_path)
