"""The entry's intake: refuse oversized prompts untokenized, tokenize off the serving path,
fairly; and the scheduler it builds from the stage configs (no server)."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest
from helpers import ROOT

from avspec.contract import StepInputs, StepOutputs
from avspec.engine.admission import Overloaded
from avspec.engine.scheduler import Scheduler
from avspec.engine.scheduler_limits import SchedulerLimits
from avspec.engine.sequence import StepReport
from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.serving.repository import (
    EntryParams,
    model_parameters,
    parse_parameters,
    read_config_parameters,
)
from avspec.serving.stages.entry import EntryIntake, StageLimits, entry_scheduler, stage_limits
from avspec.serving.stages.requests import RequestError

PARAMS = EntryParams(max_batch_size=4, max_context=512, max_draft_tokens=8)
WAIT_S = 10.0  # generous: only reached when the behaviour is wrong


def never_called(inputs: StepInputs) -> StepOutputs:
    raise AssertionError("these tests never step")


def values(text: bytes, max_tokens: int = 16) -> dict[str, np.ndarray]:
    return {
        "text_input": np.array([text], dtype=object),
        "max_tokens": np.array([max_tokens], dtype=np.int32),
    }


class Sink:
    """Records what the intake tells one request."""

    def __init__(self) -> None:
        self.seq_id: int | None = None
        self.refusal: Exception | None = None
        self.prompt_tokens: int | None = None
        self.done = threading.Event()

    def tokenized(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens

    def admitted(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.done.set()

    def refused(self, error: Exception) -> None:
        self.refusal = error
        self.done.set()

    def on_step(self, report: StepReport) -> None:
        pass

    def on_error(self, error: Exception) -> None:
        pass


class GatedTokenizer(ByteTokenizer):
    """Byte tokenizer whose encode of a text starting with "slow" waits for `gate`."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started: list[str] = []

    def encode(self, text: str, plain=()) -> list[int]:
        self.started.append(text)
        if text.startswith("slow") and not self.gate.wait(WAIT_S):
            raise TimeoutError("gate never opened")
        return super().encode(text)


@pytest.fixture
def gated():
    """A started intake over a gated tokenizer and an unstarted scheduler; stopped after."""
    tokenizer = GatedTokenizer()
    scheduler = Scheduler(never_called, 256, 4, 512, 8)
    intake = EntryIntake(scheduler, tokenizer, EntryParams(max_queued_per_client=2))
    intake.start()
    yield intake, tokenizer
    tokenizer.gate.set()
    intake.stop(timeout_s=WAIT_S)


def wait_until(condition, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def send(intake: EntryIntake, text: str, client: str) -> Sink:
    sink = Sink()
    intake.submit(intake.check(values(text.encode()), client), sink)
    return sink


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> HFTokenizer:
    from helpers.hf_dirs import EOS, tiny_tokenizer

    path = tmp_path_factory.mktemp("entry_tok")
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return HFTokenizer.from_directory(path)


def test_a_huge_prompt_is_refused_without_tokenizing(hf_tokenizer, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(hf_tokenizer, "encode", lambda text: calls.append(text) or [1])
    intake = EntryIntake(Scheduler(never_called, 1, 4, 512, 8), hf_tokenizer, PARAMS)
    assert intake.prompt_bound is not None and intake.prompt_bound.dropped == b""
    bytes_per_token = intake.prompt_bound.token_bytes
    limit = (512 - 16 - 8) * bytes_per_token  # the prompt tokens left, each at most L bytes
    with pytest.raises(RequestError, match=rf"^text_input is 1000000 bytes; at most {limit} "):
        intake.check(values(b"x" * 1_000_000), "A")
    with pytest.raises(RequestError, match=rf"text_input is {limit + 1} bytes"):
        intake.check(values(b"x" * (limit + 1)), "A")
    assert intake.check(values(b"x" * limit), "A").text == "x" * limit  # still possible
    with pytest.raises(RequestError, match="max_tokens 600 .* no room for a prompt"):
        intake.check(values(b"x" * 1_000_000, max_tokens=600), "A")
    assert calls == []
    started = time.perf_counter()
    with pytest.raises(RequestError):
        intake.check(values(b"x" * 1_000_000), "A")
    assert time.perf_counter() - started < 0.05  # a length check, not a tokenization


def test_a_slow_tokenization_does_not_delay_another_clients_request(gated) -> None:
    intake, tokenizer = gated
    started = time.perf_counter()
    slow = send(intake, "slow prompt", "A")
    fast = send(intake, "fast prompt", "B")
    assert time.perf_counter() - started < 0.5  # submit never waits for a tokenization
    assert fast.done.wait(WAIT_S) and fast.seq_id is not None  # admitted meanwhile
    assert not slow.done.is_set() and intake.scheduler.queued_by_client() == {"B": 1}
    tokenizer.gate.set()
    assert slow.done.wait(WAIT_S) and slow.seq_id is not None


def test_a_clients_backlog_waits_behind_its_own_tokenization(gated) -> None:
    """One tokenization in flight per client: A's second request waits for A's first, not the
    other workers' clients; past the queue limit A is refused at once."""
    intake, tokenizer = gated
    first = send(intake, "slow 1", "A")
    assert wait_until(lambda: tokenizer.started == ["slow 1"])  # in flight, out of the queue
    second = send(intake, "A's second", "A")
    send(intake, "A's third", "A")
    with pytest.raises(Overloaded, match="for this client"):
        send(intake, "A's fourth", "A")
    other = send(intake, "B's", "B")
    assert other.done.wait(WAIT_S) and other.seq_id is not None
    assert not second.done.is_set() and tokenizer.started.count("A's second") == 0
    tokenizer.gate.set()
    assert first.done.wait(WAIT_S) and second.done.wait(WAIT_S)
    assert first.seq_id < second.seq_id  # the client's own order is kept


def test_refusals_after_tokenizing_reach_the_sink() -> None:
    scheduler = Scheduler(
        never_called, 256, 1, 64, 8, limits=SchedulerLimits(max_queued=1, max_queued_per_client=1)
    )
    intake = EntryIntake(scheduler, ByteTokenizer(), EntryParams(max_context=64))
    intake.start()
    try:
        sinks = [send(intake, text, "A") for text in ("x" * 45, "y", "z", "w")]
        for sink in sinks:
            assert sink.done.wait(WAIT_S)
    finally:
        intake.stop(timeout_s=WAIT_S)
    too_long, *admitted, overloaded = sinks
    assert isinstance(too_long.refusal, ValueError) and "max_context 64" in str(too_long.refusal)
    assert all(sink.seq_id is not None for sink in admitted)  # a free slot + one queued
    assert isinstance(overloaded.refusal, Overloaded)


def test_stop_refuses_what_still_waits(gated) -> None:
    intake, tokenizer = gated
    send(intake, "slow", "A")
    waiting = send(intake, "next", "A")
    intake.stop(timeout_s=0.1)
    assert waiting.done.wait(WAIT_S) and "stopping" in str(waiting.refusal)
    with pytest.raises(RuntimeError, match="stopping"):
        send(intake, "late", "B")


def write_stage(root, model: str, **params: object) -> None:
    (root / model).mkdir(parents=True, exist_ok=True)
    line = 'parameters {{ key: "{}" value: {{ string_value: "{}" }} }}'
    lines = [line.format(key, value) for key, value in params.items()]
    (root / model / "config.pbtxt").write_text(f'name: "{model}"\n' + "\n".join(lines))


def test_stage_limits_are_the_tightest_of_draft_and_target(tmp_path) -> None:
    repo = tmp_path / "model_repository"
    entry = repo / "speculative"
    assert stage_limits(entry) == StageLimits()  # no stage configs: nothing stated
    write_stage(repo, "draft", model_dir="d", max_sequences=128, idle_timeout_s=600)
    write_stage(repo, "target", model_dir="t", max_sequences=96, idle_timeout_s="none")
    assert stage_limits(entry) == StageLimits(96, 600.0)


@pytest.mark.parametrize("engine", ["torch", "llamacpp"])
def test_the_smallest_shared_pool_limits_admission_on_either_engine(tmp_path, engine) -> None:
    repo = tmp_path / "model_repository"
    entry = repo / "speculative"
    write_stage(repo, "draft", engine=engine, max_sequences=8, max_length=8192,
                kv_pool_tokens=4096)  # fmt: skip
    write_stage(repo, "target", engine=engine, max_sequences=8, max_length=512)
    assert stage_limits(entry).kv_pool_tokens == 4096  # the target's 8 x 512
    write_stage(repo, "target", engine=engine, max_sequences=8, max_length=8192,
                kv_pool_tokens=2048)  # fmt: skip
    assert stage_limits(entry).kv_pool_tokens == 2048


def test_entry_scheduler_takes_the_stage_limits(caplog) -> None:
    params = EntryParams(max_batch_size=4, request_timeout_s=30.0)
    scheduler = entry_scheduler(never_called, {1}, params, StageLimits(6, 600.0))
    assert (scheduler.max_resident, scheduler.request_timeout_s) == (6, 30.0)
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        off = entry_scheduler(
            never_called, {1}, EntryParams(request_timeout_s=0.0), StageLimits(128, 600.0)
        )
    assert off.request_timeout_s is None and "idle_timeout_s 600" in caplog.text
    with pytest.raises(ValueError, match="max_batch_size 64 exceeds the stages' max_sequences 8"):
        entry_scheduler(never_called, {1}, EntryParams(), StageLimits(8, None))


def test_the_served_repository_bounds_paused_sequences() -> None:
    """The shipped configs: 128 KV slots per stage hold the 64-wide batch and what it pauses;
    the request limit (600 s) does not outlast the stages' idle sweep (600 s)."""
    limits = stage_limits(ROOT / "model_repository/speculative")
    entry_config = (ROOT / "model_repository/speculative/config.pbtxt").read_text()
    params = parse_parameters(
        EntryParams, model_parameters({"parameters": read_config_parameters(entry_config)})
    )
    assert limits == StageLimits(128, 600.0, 128 * 512)  # one pool: the cells of 128 x 512
    assert params.request_timeout_s <= limits.idle_timeout_s
    assert params.prefill_chunk == 128  # long prompts in pieces (bench/prefill_chunk)
    assert limits.max_sequences >= 2 * params.max_batch_size


def test_a_prefill_chunk_below_a_steps_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be 0 or >= max_draft_tokens"):
        EntryParams(max_draft_tokens=8, prefill_chunk=9)
    assert EntryParams(prefill_chunk=0).prefill_chunk == 0
