"""The entry model's logic without a server (avspec.serving.stages.entry_model): which error code
each failure gets, what a client is sent step by step, and cancellation.

`pb` is a stand-in for triton_python_backend_utils that records what is sent.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from avspec.engine.admission import Overloaded
from avspec.engine.scheduler import RequestTimedOut
from avspec.engine.sequence import StepReport
from avspec.serving.stages.entry_model import (
    SERVER_FAILURE,
    EntryClient,
    EntryModel,
    send_refusal,
)
from avspec.serving.stages.requests import RequestError, ResponseChunk

FINAL = 1


class Codes:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __new__(cls, message: str, code: str) -> tuple[str, str]:  # pb.TritonError(msg, code)
        return (code, message)


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []

    def send(self, response, flags: int = 0) -> None:
        self.sent.append((response, flags))


pb = SimpleNamespace(
    TritonError=Codes,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
    InferenceResponse=lambda output_tensors=None, error=None: SimpleNamespace(
        tensors={t.name: t.value for t in output_tensors or ()}, error=error
    ),
    Tensor=lambda name, value: SimpleNamespace(name=name, value=value),
)


@pytest.mark.parametrize(
    ("error", "code", "prefix"),
    [
        (RequestError("'max_tokens' must be >= 1"), "INVALID_ARG", "'max_tokens'"),
        (ValueError("text_input is empty"), "INVALID_ARG", "text_input"),
        (Overloaded("overloaded: 65 requests queued; retry later"), "UNAVAILABLE", "overloaded"),
        (KeyError("boom"), "INTERNAL", SERVER_FAILURE),
    ],
)
def test_each_refusal_gets_its_code_in_one_final_response(error, code, prefix) -> None:
    sender = Sender()
    send_refusal(pb, sender, error)
    [(response, flags)] = sender.sent
    assert flags == FINAL and response.error[0] == code
    assert response.error[1].startswith(prefix)


class FakeStream:
    """ResponseStream's part the client uses: one chunk per report, final when finished."""

    def on_step(self, report: StepReport) -> ResponseChunk | None:
        if not report.new_tokens and not report.finished:
            return None
        text = "".join(chr(96 + t) for t in report.new_tokens)
        ids = tuple(report.new_tokens)
        return ResponseChunk(text, report.drafted, report.verified, report.accepted,
                             report.finished, ids)  # fmt: skip


class FakeScheduler:
    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def cancel(self, seq_id: int) -> bool:
        self.cancelled.append(seq_id)
        return True


def client(cancelled: bool = False) -> tuple[EntryClient, Sender, FakeScheduler]:
    sender, scheduler = Sender(), FakeScheduler()
    request = SimpleNamespace(is_cancelled=lambda: cancelled)
    return EntryClient(pb, request, sender, FakeStream(), scheduler), sender, scheduler


def test_chunks_go_out_with_the_final_flag_only_on_the_last() -> None:
    entry, sender, _ = client()
    entry.admitted(7)
    entry.on_step(StepReport([1, 2], 4, 3, 1, False, None))
    entry.on_step(StepReport([], 0, 0, 0, False, None))  # nothing to send
    entry.on_step(StepReport([3], 2, 2, 2, True, "length"))
    entry.on_step(StepReport([4], 2, 2, 2, True, "length"))  # after the end: ignored
    assert [flags for _, flags in sender.sent] == [0, FINAL]
    first, last = (response.tensors for response, _ in sender.sent)
    assert first["text_output"].tolist() == [b"ab"] and first["output_ids"].tolist() == [1, 2]
    assert (first["drafted_tokens"][0], first["verified_tokens"][0]) == (4, 3)
    assert last["accepted_tokens"].tolist() == [2]


def test_a_cancelled_request_is_cancelled_in_the_scheduler() -> None:
    entry, _, scheduler = client(cancelled=True)
    entry.on_step(StepReport([1], 1, 1, 1, False, None))  # not admitted yet: nothing to cancel
    entry.admitted(9)
    entry.on_step(StepReport([2], 1, 1, 1, False, None))
    assert scheduler.cancelled == [9]


@pytest.mark.parametrize(
    ("error", "code"),
    [(RequestTimedOut("request ran past the server's limit"), "UNAVAILABLE"),
     (RuntimeError("speculative_step: stub died"), "INTERNAL")],
)  # fmt: skip
def test_a_failure_mid_request_ends_it_once_with_the_right_code(error, code) -> None:
    entry, sender, _ = client()
    entry.on_error(error)
    entry.on_error(error)
    entry.refused(error)
    [(response, flags)] = sender.sent
    assert flags == FINAL and response.error[0] == code
    if code == "INTERNAL":  # the front turns this prefix into a 500
        assert response.error[1] == f"{SERVER_FAILURE}: speculative_step: stub died"


def test_execute_refuses_a_bad_request_and_goes_on_with_the_next() -> None:
    """A request the intake refuses gets its error; the others in the same call are handed on."""
    reading = SimpleNamespace(
        **vars(pb),
        get_input_tensor_by_name=lambda request, name: SimpleNamespace(
            as_numpy=lambda: request.text
        ),
    )
    model = type("Model", (EntryModel,), {"pb": reading})()
    senders = [Sender(), Sender()]
    requests = [
        SimpleNamespace(text=text, get_response_sender=lambda s=s: s, parameters=lambda: "{}")
        for text, s in zip(["bad", "good"], senders, strict=True)
    ]
    submitted = []

    def check(values, identity):
        if values["text_input"] == "bad":
            raise RequestError("text_input: bad")
        return SimpleNamespace(stream=False)

    model.input_names = ["text_input"]
    model.tokenizer = SimpleNamespace(incremental_decoder=lambda: None)
    model.scheduler = FakeScheduler()
    model.intake = SimpleNamespace(check=check, submit=lambda p, c: submitted.append(c))
    model.execute(requests)
    [(response, flags)] = senders[0].sent
    assert response.error[0] == "INVALID_ARG" and flags == FINAL
    assert not senders[1].sent and len(submitted) == 1 and submitted[0].sender is senders[1]
