"""`avspec.tools.train.draft.model_card` (and its card_measure, card_cost, card_render): the model
card of a (target, draft) pair.

On a tiny seeded pair (`helpers.chat_pair.save_smooth_chat_pair`: spread-out distributions, a
draft close to the target, so acceptance is high and depends on the warping):

- the card has every section, and its acceptance table is what it measured;
- the acceptance figures equal an independent recomputation of the same contexts and draws by
  `avspec.tools.train.tiny.evaluate.acceptance_by_position`;
- the card's acceptance table is reproduced by the command at its top, rerun on fewer contexts
  with another seed, within 4 combined standard errors at every position (here the worst of
  the 8 is 1.7 apart), while a card made with the draft's distribution un-warped (a plausible
  bug) fails the same check (7 of the 8 positions more than 4 apart);
- verification outcomes, the estimator fit and the cost section on synthetic inputs.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from helpers.chat_pair import save_smooth_chat_pair

import avspec.tools.train.draft.evaluate as evaluate
from avspec.av.cost_file import load_step_cost, save_step_cost
from avspec.av.features import logit_qmax
from avspec.av.step_cost import StepCost
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.tools.train.draft.__main__ import main as draft_main
from avspec.tools.train.draft.card_cost import cost_section
from avspec.tools.train.draft.card_measure import (
    DEPTH,
    SAMPLE_PROMPTS,
    acceptance_table,
    calibration,
    chat_sequences,
    verification_outcomes,
)
from avspec.tools.train.draft.card_render import (
    ACCEPTANCE_HEADER,
    read_acceptance_table,
    render_card,
)
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P, DraftChains, draft_chains
from avspec.tools.train.draft.generate import chat_renderer
from avspec.tools.train.draft.model_card import disagreements, write_card
from avspec.tools.train.draft.prompts import build_prompts
from avspec.tools.train.tiny.corpus import corpus_files, split_files
from avspec.tools.train.tiny.evaluate import acceptance_by_position, warp

pytestmark = pytest.mark.usefixtures("single_thread")

CONTEXTS = 32  # the card's
RERUN_CONTEXTS = 24  # the rerun's, with another seed


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_smooth_chat_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def card(pair, tmp_path_factory):
    """(path of the card written by the tool, its measurements)."""
    path = tmp_path_factory.mktemp("card") / "MODEL_CARD.md"
    return path, write_card(*pair, path, contexts=CONTEXTS, seed=0)


def test_card_has_every_section(card, pair):
    path, measured = card
    text = path.read_text()
    for heading in (
        "# Model card: target (target) + draft (draft)",
        "## The pair",
        "## Acceptance by draft position",
        "## Calibration of logit(q_max)",
        "## Cost ratio",
        "## Greedy answers",
    ):
        assert heading in text, heading
    command = re.search(r"```bash\n(.+)\n```", text).group(1)
    assert command == (
        f"python -m avspec.tools.train.draft --only card --target {pair[0]} --out {pair[1]} "
        f"--card {path} --card-contexts {CONTEXTS} --seed 0 --threads 1"
    )
    assert text.index(command) < text.index("## The pair")  # the command comes first
    rows = read_acceptance_table(text)
    assert [r["position"] for r in rows] == list(range(1, DEPTH + 1))
    for row, exact in zip(rows, measured["acceptance"], strict=True):
        assert row["contexts"] == CONTEXTS
        assert row["acceptance"] == pytest.approx(exact["acceptance"], abs=5e-4)
        assert row["se"] == pytest.approx(exact["se"], abs=5e-4) and row["se"] > 0
    assert "| 0.9-1.0 |" in text  # the reliability table's last bin
    assert "Fitted ECE on the held-out half: **" in text
    assert "Not measured: no cost-tables file was given" in text
    assert "No `training_report.json` in the draft directory" in text
    assert all(f"**{prompt}**" in text for prompt in SAMPLE_PROMPTS)
    assert (
        measured["calibration"]["fit_labels"] + measured["calibration"]["eval_labels"]
        == (measured["calibration"]["labels"])
    )


def test_acceptance_equals_an_independent_recomputation(pair):
    target_dir, draft_dir = pair
    target = load_model(target_dir, dtype=torch.bfloat16, max_length=600)
    draft = load_model(draft_dir, dtype=torch.bfloat16, max_length=600)
    _, held_out = split_files(corpus_files())
    prompts = build_prompts(held_out, 3, seed=5)
    eos = load_tokenizer(target_dir).eos_ids
    sequences = chat_sequences(target, chat_renderer(target_dir), eos, prompts, seed=5)
    table = acceptance_table(draft_chains(draft, target, sequences, DEPTH, 1, seed=5))
    # The same cuts and draft draws, through the old pair's helper, one context at a time.
    generator = torch.Generator().manual_seed(5)
    curves = []
    for seq in sequences:
        cut = int(torch.randint(0, seq["answer_length"], (1,), generator=generator))
        context = seq["ids"][: seq["prompt_length"] + cut][None]
        curves.append(
            acceptance_by_position(
                draft, target, context, DEPTH, TEMPERATURE, TOP_P, generator=generator
            )
        )
    expected = torch.tensor(curves, dtype=torch.float64)
    assert [r["acceptance"] for r in table] == pytest.approx(expected.mean(0).tolist(), abs=1e-6)
    se = (expected.std(0) / math.sqrt(len(curves))).tolist()
    assert [r["se"] for r in table] == pytest.approx(se, abs=1e-6)


def _unwarped_chain(draft, target, context, depth, generator=None, warp_to=None):
    """`evaluate.draft_chain` with the bug to catch: the draft samples and scores its raw
    distribution (temperature 1, no top-p) while the target's is warped."""
    ids, qs = context[None], []
    for _ in range(depth):
        q = torch.softmax(draft(ids)[:, -1].float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(q, 1, generator=generator)], dim=1)
        qs.append(q[0])
    p = warp(target(ids[:, :-1])[:, len(context) - 1 :], TEMPERATURE, TOP_P)[0]
    q = torch.stack(qs)
    drafted = ids[0, len(context) :, None]
    ratio = (p.gather(-1, drafted) / q.gather(-1, drafted))[:, 0].clamp(max=1.0)
    feature = logit_qmax(q.log()[None], 1.0)[0]
    return torch.minimum(p, q).sum(-1), q.max(-1).values, feature, ratio


def _rerun(command: str, card: Path, **changes: str) -> list[dict]:
    """Run a card's command through the CLI with some options changed; its acceptance rows."""
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "avspec.tools.train.draft"]
    args = args[3:]
    for option, value in (changes | {"card": str(card)}).items():
        flag = "--" + option.replace("_", "-")
        args[args.index(flag) + 1] = value
    draft_main(args)
    return read_acceptance_table(card.read_text())


def test_card_acceptance_is_reproduced_by_its_command(card, tmp_path, monkeypatch):
    text = card[0].read_text()
    command = re.search(r"```bash\n(.+)\n```", text).group(1)
    rows = read_acceptance_table(text)
    rerun = _rerun(command, tmp_path / "rerun.md", seed="1", card_contexts=str(RERUN_CONTEXTS))
    assert [r["contexts"] for r in rerun] == [RERUN_CONTEXTS] * DEPTH
    assert disagreements(rows, rerun) == []
    # The same check on a card whose table was made with the draft's q un-warped.
    monkeypatch.setattr(evaluate, "draft_chain", _unwarped_chain)
    broken = _rerun(command, tmp_path / "broken.md")
    assert disagreements(broken, rerun) != []


def test_disagreements():
    row = {"position": 1, "acceptance": 0.5, "se": 0.03, "contexts": 10}
    assert disagreements([row], [row | {"acceptance": 0.5 + 4 * 0.0424}]) == []
    assert disagreements([row], [row | {"acceptance": 0.5 + 4 * 0.0425}]) == [1]
    assert disagreements([row], [row | {"position": 2}]) == [1, 2]  # missing either side
    assert disagreements([row | {"se": math.nan}], [row]) == [1]  # no error bar: no pass


def test_read_acceptance_table_reads_the_rendered_rows():
    text = f"x\n\n{ACCEPTANCE_HEADER}\n|---|---|---|---|\n| 1 | 0.500 | 0.010 | 7 |\n| 2 | 0.250 | 0.020 | 7 |\n\ny"  # noqa: E501
    assert read_acceptance_table(text) == [
        {"position": 1, "acceptance": 0.5, "se": 0.01, "contexts": 7},
        {"position": 2, "acceptance": 0.25, "se": 0.02, "contexts": 7},
    ]


def _chains(ratio: torch.Tensor, feature: torch.Tensor | None = None) -> DraftChains:
    feature = torch.zeros_like(ratio) if feature is None else feature
    return DraftChains(ratio, torch.full_like(ratio, 0.5), feature, ratio)


def test_verification_outcomes_label_up_to_the_first_rejection():
    ratio = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    labels, mask = verification_outcomes(_chains(ratio), seed=0)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert labels[mask].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]


def test_calibration_of_a_well_specified_estimator():
    """Acceptance drawn from sigmoid(1.5 f - 0.3 k): the fit recovers the slope and the held-out
    ECE is at the sampling-noise floor."""
    gen = torch.Generator().manual_seed(0)
    feature = torch.randn(4000, 3, generator=gen, dtype=torch.float64)
    ratio = torch.sigmoid(1.5 * feature - 0.3 * torch.arange(3))
    cal = calibration(_chains(ratio, feature), seed=1)
    assert cal["slope"] == pytest.approx(1.5, abs=0.15)
    assert cal["intercepts"] == pytest.approx([0.0, -0.3, -0.6], abs=0.2)
    assert cal["ece"] < cal["ece_noise_mean"] + 3 * cal["ece_noise_sd"]
    assert cal["auc_soft_served_all"] > 0.7 and cal["auc_sampled_served"] > 0.7
    assert sum(r["labels"] for r in cal["reliability"]) == cal["eval_labels"]


def _cost_file(path: Path, models: str, date: datetime) -> Path:
    cost = StepCost.linear(1.0, 0.05, 10.0, 0.2, 64, 600, overhead_ms=3.0, verify_row_ms=0.5)
    save_step_cost(path, cost, {"models": models, "date": date.isoformat(timespec="seconds")})
    return path


def test_cost_section_for_this_pair_and_for_others(card, pair, tmp_path):
    target_dir, draft_dir = pair
    now = datetime.now(UTC) + timedelta(seconds=5)
    ours = _cost_file(tmp_path / "ours.json", f"{target_dir} + {draft_dir} (bfloat16)", now)
    section = cost_section(ours, target_dir, draft_dir)
    assert section["this_pair"]
    cost = load_step_cost(ours)
    for row in section["rows"]:
        r = row["rows"]
        assert row["ratio"] == pytest.approx(cost.verify_ms(r, r) / cost.draft_pass.at(r))
    assert [row["rows"] for row in section["rows"]] == [1, 64]
    text = render_card(card[1] | {"cost": section}, "cmd")
    # a pass of 64 rows: 1 + 0.05 * 64 ms; a step of 64 rows: 10 + 0.2 * 64 + 0.5 * 64 ms
    assert "| 64 | 4.20 | 54.80 | 13.05 |" in text

    # The same weights measured at other paths (a copy) are this pair; other weights are not.
    copy = shutil.copytree(target_dir, tmp_path / "copy")
    moved = _cost_file(tmp_path / "moved.json", f"{copy} + {draft_dir}", now)
    assert cost_section(moved, target_dir, draft_dir)["this_pair"]
    others = {
        "other weights": _cost_file(tmp_path / "a.json", f"{draft_dir} + {draft_dir}", now),
        "missing": _cost_file(tmp_path / "b.json", f"{tmp_path / 'gone'} + {draft_dir}", now),
        "too old": _cost_file(
            tmp_path / "c.json", f"{target_dir} + {draft_dir}", now - timedelta(days=1)
        ),
        "random": _cost_file(tmp_path / "d.json", "random-weight pair (6x320)", now),
    }
    for name, path in others.items():
        section = cost_section(path, target_dir, draft_dir)
        assert not section["this_pair"] and "rows" not in section, name
        text = render_card(card[1] | {"cost": section}, "cmd")
        assert "**Not this pair**" in text and "| rows |" not in text, name
    assert "before the weights" in cost_section(others["too old"], target_dir, draft_dir)["why"]
    unnamed = tmp_path / "e.json"
    document = json.loads(others["random"].read_text())
    document["measured"] = {}
    unnamed.write_text(json.dumps(document))
    assert "does not say" in cost_section(unnamed, target_dir, draft_dir)["why"]


def test_training_summary_from_the_draft_directory(card, tmp_path):
    report = {
        "training": {"step": 849, "elapsed": 5852.0, "seen": 1766515},
        "heldout": {"acceptance_1": 0.4649, "auc_logit_q_max": 0.7601, "positions": 9315},
        "last_log": {"train_kl": 1.349},
    }
    measured = card[1] | {"draft": card[1]["draft"] | {"training_report": report}}
    text = render_card(measured, "cmd")
    assert "849 steps in 98 min, 1,766,515 answer positions seen" in text
    assert "held-out acceptance at position 1 0.465 and AUC of logit(q_max) 0.760" in text


def test_chat_sequences_end_inside_the_answer(pair):
    target_dir, _ = pair
    target = load_model(target_dir, dtype=torch.bfloat16, max_length=600)
    _, held_out = split_files(corpus_files())
    prompts = build_prompts(held_out, 2, seed=3)
    eos = load_tokenizer(target_dir).eos_ids
    renderer = chat_renderer(target_dir)
    for seq, prompt in zip(
        chat_sequences(target, renderer, eos, prompts, seed=3, max_new_tokens=5), prompts,
        strict=True,
    ):  # fmt: skip
        text = renderer.decode(seq["ids"][: seq["prompt_length"]].tolist())
        assert text.endswith("<|im_start|>assistant\n") and prompt.message[:20] in text
        assert len(seq["ids"]) == seq["prompt_length"] + seq["answer_length"] - 1
        assert 1 <= seq["answer_length"] <= 5


def test_a_fine_tune_names_its_start_and_the_raw_held_out_figures():
    from avspec.tools.train.draft.card_render import _training_lines

    report = {
        "training": {"step": 10, "elapsed": 600.0, "seen": 1000, "init_from": "models/draft",
                     "shape": {"target_layers": [0, 1, 2]}},
        "heldout": {"acceptance_1": 0.559, "auc_logit_q_max": 0.757, "positions": 9446},
        "heldout_raw": {"acceptance_1": 0.513, "auc_logit_q_max": 0.745, "positions": 11178},
        "init": {"heldout": {"acceptance_1": 0.554}, "heldout_raw": {"acceptance_1": 0.464}},
    }  # fmt: skip
    text = " ".join(_training_lines(report))
    assert (
        "raw code / prose prefixes" in text and "a fine-tune of the draft in `models/draft`" in text
    )
    assert "0.513 and 0.745 over 11178" in text
    assert "0.554 (heldout), 0.464 (heldout raw)" in text
    del report["training"]["init_from"]
    plain = " ".join(_training_lines({"training": report["training"]}))
    assert "fine-tune" not in plain and "raw" not in plain
