"""Request parsing and response assembly of the entry model (no server)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import ROOT

from avspec.engine.sequence import StepReport
from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.serving.repository import (
    EntryParams,
    model_parameters,
    parse_parameters,
    read_config_parameters,
    served_tokenizer_dir,
    target_model_dir,
)
from avspec.serving.stages.prompt_bound import PromptBound
from avspec.serving.stages.requests import (
    MAX_TEMPERATURE,
    RequestError,
    ResponseStream,
    entry_tokenizer,
    parse_client,
    parse_generation_inputs,
    parse_prompt_request,
)

ENTRY_CONFIG = ROOT / "model_repository/speculative/config.pbtxt"

PARAMS = EntryParams(max_draft_tokens=8, adaptive_verification=True)
TOKENIZER = ByteTokenizer()


def inputs(**values: object) -> dict[str, np.ndarray]:
    base: dict[str, object] = {"text_input": b"hi", "max_tokens": 4}
    base.update(values)
    return {
        k: np.array([v], dtype=object if isinstance(v, bytes) else None) for k, v in base.items()
    }


def parse(**values: object):
    return parse_generation_inputs(inputs(**values), PARAMS, TOKENIZER)


def test_defaults() -> None:
    request, stream = parse()
    assert request.prompt_ids == [104, 105] and request.max_tokens == 4
    assert (request.temperature, request.top_p, request.random_seed) == (1.0, 1.0, 0)
    assert request.num_draft_tokens == 8 and request.adaptive is True and stream is False
    assert request.ignore_eos is False


def test_all_inputs() -> None:
    request, stream = parse(
        temperature=np.float32(0.0), top_p=np.float32(0.9), random_seed=np.uint64(2**64 - 1),
        stream=True, num_draft_tokens=np.int32(0), adaptive_verification=False, ignore_eos=True,
    )  # fmt: skip
    assert request.temperature == 0.0 and request.top_p == pytest.approx(0.9)
    assert 0 <= request.random_seed < 2**63
    assert request.num_draft_tokens == 0 and request.adaptive is False and stream is True
    assert request.ignore_eos is True


def test_adaptive_default_from_parameters() -> None:
    request, _ = parse_generation_inputs(
        inputs(), EntryParams(adaptive_verification=False), TOKENIZER
    )
    assert request.adaptive is False


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"text_input": b""}, "text_input"),
        ({"text_input": b"\xff\xfe"}, "UTF-8"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"num_draft_tokens": 9}, "num_draft_tokens"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": np.float32(MAX_TEMPERATURE) * 1.01}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"top_p": float("-inf")}, "top_p"),
        # wider integers than declared are refused as received, never wrapped into int32
        ({"max_tokens": np.uint64(4294967300)}, "max_tokens must lie in 1..2147483647"),
        ({"max_tokens": np.int64(4294967300)}, "max_tokens"),
        ({"max_tokens": np.int64(2**31)}, "max_tokens"),
        ({"max_tokens": np.int64(-(2**40))}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"num_draft_tokens": np.uint64(2**32 + 3)}, "num_draft_tokens"),
        ({"random_seed": 1.5}, "random_seed must be an integer"),
    ],
)
def test_invalid_inputs_name_the_problem(values: dict, problem: str) -> None:
    with pytest.raises(RequestError, match=problem):
        parse(**values)


def test_integer_and_temperature_bounds_are_inclusive() -> None:
    values = inputs(max_tokens=np.uint64(2**31 - 1), temperature=MAX_TEMPERATURE)
    room = EntryParams(max_context=2**31 + 8)  # the largest max_tokens still leaves a prompt
    request, _ = parse_generation_inputs(values, room, TOKENIZER)
    assert request.max_tokens == 2**31 - 1 and request.temperature == MAX_TEMPERATURE
    request, _ = parse(random_seed=np.int64(-1))
    assert request.random_seed == 2**63 - 1


def test_an_oversized_prompt_is_refused_by_its_counted_bytes() -> None:
    """Bytes the tokenizer drops without a token are not counted; the rest may fill the room's
    tokens times L; a megabyte is refused in a count, not a tokenization."""
    bound = PromptBound(4, dropped=b"\x13\xff")
    room = 100 - 4 - 8  # max_context, max_tokens, draft tokens
    params = EntryParams(max_context=100, max_draft_tokens=8)
    fits = b"\x13" * 10_000 + b"x" * (room * 4)
    assert parse_prompt_request(inputs(text_input=fits), params, "", bound).text.endswith("x")
    with pytest.raises(
        RequestError,
        match=rf"^text_input is {len(fits) + 1} bytes \({room * 4 + 1} counted: the tokenizer "
        rf"drops the other 10000 without a token\); at most {room * 4} counted bytes can fit "
        rf"the {room} prompt tokens .* \(a token spans at most 4 counted bytes\)$",
    ):
        parse_prompt_request(inputs(text_input=fits + b"x"), params, "", bound)
    with pytest.raises(RequestError, match=r"^text_input is \d+ bytes; at most 352 bytes "):
        parse_prompt_request(inputs(text_input=b"x" * 353), params, "", PromptBound(4))
    megabyte = b"The quick brown fox jumps over the lazy dog. " * 22_223
    started = time.perf_counter()
    with pytest.raises(RequestError, match="^text_input is 1000035 bytes; at most 352 counted"):
        parse_prompt_request(inputs(text_input=megabyte), params, "", bound)
    assert time.perf_counter() - started < 0.05


@pytest.mark.parametrize(
    ("parameters", "client"),
    [
        (None, ""),
        ("", ""),
        ("{}", ""),
        ('{"priority": 1}', ""),
        ('{"avspec-client": "tenant-7"}', "tenant-7"),
        ('{"Avspec-Client": "tenant-7"}', "tenant-7"),
        ('{"avspec-client": ""}', ""),
    ],
)
def test_parse_client(parameters: str | None, client: str) -> None:
    assert parse_client(parameters) == client


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        ('{"avspec-client": 7}', "avspec-client must be a string"),
        ('{"avspec-client": "' + "x" * 257 + '"}', "at most 256"),
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
    ],
)
def test_parse_client_refuses(parameters: str, problem: str) -> None:
    with pytest.raises(RequestError, match=problem):
        parse_client(parameters)


def test_client_reaches_the_request() -> None:
    request, _ = parse_generation_inputs(inputs(), PARAMS, TOKENIZER, client="tenant-7")
    assert request.client == "tenant-7"
    assert parse()[0].client == ""


def test_entry_config_lists_the_admission_and_refit_parameters() -> None:
    params = read_config_parameters(ENTRY_CONFIG.read_text())
    entry = parse_parameters(EntryParams, model_parameters({"parameters": params}))
    assert (entry.max_queued, entry.max_queued_per_client) == (256, 64)
    assert (entry.refit_max_temperature, entry.refit_client_share) == (2.0, 0.25)
    assert entry.request_timeout_s == 600.0
    assert entry == EntryParams(max_context=entry.max_context)  # config agrees with the defaults
    unbounded = parse_parameters(EntryParams, {"max_queued": "none", "max_queued_per_client": ""})
    assert unbounded.max_queued is None and unbounded.max_queued_per_client is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_queued", 0),
        ("max_queued_per_client", 0),
        ("refit_max_temperature", -1.0),
        ("refit_max_temperature", float("nan")),
        ("refit_client_share", 0.0),
        ("refit_client_share", 1.5),
        ("request_timeout_s", -1.0),
        ("request_timeout_s", float("inf")),
        ("request_timeout_s", float("nan")),
    ],
)
def test_entry_params_reject_bad_admission_and_refit_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EntryParams(**{field: value})


def test_missing_required_inputs() -> None:
    with pytest.raises(RequestError, match="text_input is required"):
        parse_generation_inputs({"max_tokens": np.array([3])}, PARAMS, TOKENIZER)
    with pytest.raises(RequestError, match="max_tokens is required"):
        parse_generation_inputs({"text_input": np.array([b"x"], dtype=object)}, PARAMS, TOKENIZER)


def test_more_than_one_value() -> None:
    values = inputs()
    values["max_tokens"] = np.array([1, 2])
    with pytest.raises(RequestError, match="exactly one value"):
        parse_generation_inputs(values, PARAMS, TOKENIZER)


def report(tokens: list[int], drafted: int = 2, finished: bool = False) -> StepReport:
    return StepReport(tokens, drafted, 2, 1, finished, "length" if finished else None)


def test_stream_sends_each_step_with_complete_characters() -> None:
    stream = ResponseStream(stream=True, tokenizer=TOKENIZER)
    euro = list("€".encode())  # three bytes split across two steps
    first = stream.on_step(report([ord("a"), euro[0]]))
    second = stream.on_step(report(euro[1:], finished=True))
    assert (first.text, first.final, first.drafted) == ("a", False, 2)
    assert (second.text, second.final) == ("€", True)


def test_non_stream_sends_once_with_totals() -> None:
    stream = ResponseStream(stream=False, tokenizer=TOKENIZER)
    assert stream.on_step(report([ord("a")])) is None
    final = stream.on_step(report([ord("b"), 256], drafted=3, finished=True))
    assert (final.text, final.drafted, final.verified, final.accepted) == ("ab", 5, 4, 2)
    assert final.final and stream.finish_reason == "length"


# --- any Tokenizer: the target model's, chosen by entry_tokenizer ---


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A model directory holding only a tiny Hugging Face tokenizer (and its config files)."""
    from helpers.hf_dirs import BOS, EOS, tiny_tokenizer

    path = tmp_path_factory.mktemp("hf_tok")
    tok = tiny_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    (path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 1, "bos_token_id": 0})
    )
    return path


def test_hugging_face_tokenizer_parses_and_streams(hf_tokenizer_dir) -> None:
    tokenizer = HFTokenizer.from_directory(hf_tokenizer_dir)
    text = "The quick brown fox — naïve 🚀"
    request, _ = parse_generation_inputs(inputs(text_input=text.encode()), PARAMS, tokenizer)
    assert request.prompt_ids == tokenizer.encode(text) and request.prompt_ids[0] == 0
    ids = tokenizer.encode(text)[1:]
    stream = ResponseStream(stream=True, tokenizer=tokenizer)
    chunks = [stream.on_step(report([i])) for i in ids]
    chunks.append(stream.on_step(report([1], finished=True)))  # EOS: not part of the text
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids) == text
    whole = ResponseStream(stream=False, tokenizer=tokenizer)
    for i in ids:
        whole.on_step(report([i]))
    assert whole.on_step(report([], finished=True)).text == text


def write_entry_repository(root, target_params: str):
    """A project root with a model repository holding the entry and a target config."""
    (root / "model_repository/speculative").mkdir(parents=True)
    (root / "model_repository/target").mkdir(parents=True)
    (root / "model_repository/target/config.pbtxt").write_text(f'name: "target"\n{target_params}')
    return root / "model_repository/speculative"


def test_entry_tokenizer_is_the_targets(tmp_path, hf_tokenizer_dir) -> None:
    param = 'parameters {{ key: "model_dir" value: {{ string_value: "{}" }} }}\n'
    entry = write_entry_repository(tmp_path / "hf", param.format(hf_tokenizer_dir))
    tokenizer = entry_tokenizer(entry)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_ids == {1}
    # no model_dir, or no target config: an error naming what is missing, no fallback
    with pytest.raises(ValueError, match="no model_dir parameter"):
        entry_tokenizer(write_entry_repository(tmp_path / "none", ""))
    with pytest.raises(ValueError, match="target/config.pbtxt not found"):
        entry_tokenizer(tmp_path / "elsewhere/model_repository/x")
    # a relative model_dir resolves against the project root; a bad one names the directory
    entry = write_entry_repository(tmp_path / "bad", param.format("models/missing"))
    with pytest.raises(ValueError, match="models/missing"):
        entry_tokenizer(entry)
    # a directory of the retired format: refused by name
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"format": "avspec-transformer", "version": 1}))
    entry = write_entry_repository(tmp_path / "retired", param.format(old))
    with pytest.raises(ValueError, match="retired format"):
        entry_tokenizer(entry)


def test_served_tokenizer_dir_is_the_targets_or_none(tmp_path, hf_tokenizer_dir) -> None:
    """The front's OpenAI routes take the entry's tokenizer directory; a repository without a
    target (test models) serves them not, and still starts."""
    param = f'parameters {{ key: "model_dir" value: {{ string_value: "{hf_tokenizer_dir}" }} }}\n'
    entry = write_entry_repository(tmp_path / "hf", param)
    assert served_tokenizer_dir(entry) == target_model_dir(entry) == hf_tokenizer_dir
    assert served_tokenizer_dir(write_entry_repository(tmp_path / "none", "")) is None
    assert served_tokenizer_dir(tmp_path / "elsewhere/model_repository/x") is None


def test_plain_spans_become_character_spans_tokenized_as_text() -> None:
    text = "héllo <x> wörld"
    raw = text.encode()
    start, end = raw.index(b"<x>"), len(raw)
    prompt = parse_prompt_request(
        {**inputs(text_input=raw), "plain_spans": np.array([start, end], dtype=np.int32)}, PARAMS
    )
    assert prompt.plain == ((text.index("<x>"), len(text)),)
    seen = []

    class Recording(ByteTokenizer):
        def encode(self, text: str, plain=()) -> list[int]:
            seen.append(plain)
            return super().encode(text)

    assert prompt.tokenize(Recording()).prompt_ids == list(raw)
    assert seen == [prompt.plain]


@pytest.mark.parametrize(
    ("spans", "problem"),
    [
        ([1], "pairs of integers"),
        ([4, 2], "ascending, disjoint"),
        ([0, 3, 2, 5], "ascending, disjoint"),
        ([0, 99], "within text_input's 6 bytes"),
        ([0, 2], "splits a UTF-8 character"),
        ([-1, 2], "ascending, disjoint"),
    ],
)
def test_bad_plain_spans_name_the_input(spans: list[int], problem: str) -> None:
    values = {**inputs(text_input="aébcd".encode()), "plain_spans": np.array(spans)}
    with pytest.raises(RequestError, match=problem):
        parse_prompt_request(values, PARAMS)
