"""The entry model `speculative`: text in, text out (decoupled), every request batched in flight.

`execute` only checks each request's inputs (no tokenizing) and hands it to an
avspec.serving.stages.entry.EntryIntake, whose workers tokenize it and submit it to one
avspec.engine.scheduler.Scheduler; the scheduler's background thread runs one BLS call of the
`speculative_step` ensemble per decode step for the whole batch, and each request's `EntryClient`
sends its responses (avspec.serving.stages.requests.ResponseStream).

Errors are final responses with a Triton error code: INVALID_ARG for the client's mistakes,
UNAVAILABLE for a full queue or a request past `request_timeout_s` (retry later), INTERNAL for a
server failure. Triton 2.51 answers 400 over HTTP to every error of a decoupled model, so a server
failure's message starts with `generation failed`, which the front maps to 500
(avspec.serving.front.http_status.ENTRY_SERVER_ERRORS).

`pb` (triton_python_backend_utils) is passed in as a class attribute by model.py, as for the
stage models (avspec.serving.stages.triton_model); its attributes are read at call time.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from avspec.contract import StepInputs, StepOutputs
from avspec.engine.admission import Overloaded
from avspec.engine.scheduler import RequestTimedOut, Scheduler
from avspec.engine.sequence import StepReport
from avspec.serving import repository
from avspec.serving.stages.entry import EntryIntake, entry_scheduler, stage_limits
from avspec.serving.stages.metrics import LIVE_SEQUENCES
from avspec.serving.stages.requests import (
    RequestError,
    ResponseChunk,
    ResponseStream,
    entry_tokenizer,
    parse_client,
)
from avspec.serving.stages.triton_model import make_metric_family

SERVER_FAILURE = "generation failed"  # the prefix the front maps to 500


class EntryModel:
    """The `speculative` model; model.py subclasses it with `pb = pb_utils`."""

    pb: ClassVar[Any]

    def initialize(self, args: Mapping[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.params = repository.parse_parameters(
            repository.EntryParams, repository.model_parameters(config)
        )
        self.input_names = [tensor["name"] for tensor in config["input"]]
        # the target model's tokenizer (the tokenizer.json of its model_dir)
        self.tokenizer = entry_tokenizer(args["model_repository"])
        self.live_family = make_metric_family(self.pb, LIVE_SEQUENCES)
        self.live = self.live_family.Metric(labels={})
        self.live.set(0)
        self.scheduler = entry_scheduler(
            self.step,
            self.tokenizer.eos_ids,
            self.params,
            stage_limits(args["model_repository"]),
            # ids never seen before: a restarted entry must not continue a dead one's sequences
            first_seq_id=secrets.randbits(61) + 1,
        )
        self.intake = EntryIntake(self.scheduler, self.tokenizer, self.params)
        self.scheduler.start()
        self.intake.start()

    def execute(self, requests: Sequence[Any]) -> None:
        """Check and hand over each request; every refusal is a final error response."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                values = {}
                for name in self.input_names:
                    tensor = self.pb.get_input_tensor_by_name(request, name)
                    values[name] = None if tensor is None else tensor.as_numpy()
                identity = parse_client(request.parameters())
                prompt = self.intake.check(values, identity)  # refuses, never tokenizes
                stream = ResponseStream(prompt.stream, self.tokenizer)
                client = EntryClient(self.pb, request, sender, stream, self.scheduler)
                self.intake.submit(prompt, client)  # tokenized and submitted by its workers
            except Exception as err:  # noqa: BLE001 - never leave a stream open
                send_refusal(self.pb, sender, err)
        return None

    def finalize(self) -> None:
        self.intake.stop(timeout_s=10)
        self.scheduler.stop(timeout_s=10)

    def step(self, inputs: StepInputs) -> StepOutputs:
        """The scheduler's step function: one BLS call of the step ensemble for the batch."""
        self.live.set(self.scheduler.live_count)
        arrays = repository.step_inputs_to_numpy(inputs)
        response = self.pb.InferenceRequest(
            model_name=self.params.step_model,
            inputs=[self.pb.Tensor(name, value) for name, value in arrays.items()],
            requested_output_names=list(repository.STEP_OUTPUT_DTYPES),
        ).exec()
        if response.has_error():
            raise RuntimeError(f"{self.params.step_model}: {response.error().message()}")
        outputs = {
            name: self.pb.get_output_tensor_by_name(response, name).as_numpy()
            for name in repository.STEP_OUTPUT_DTYPES
        }
        return repository.step_outputs_from_numpy(outputs)


class EntryClient:
    """One request's response sender (an avspec.serving.stages.entry.RequestSink), fed by the
    intake's workers (admitted, refused) and the scheduler thread (on_step, on_error)."""

    def __init__(
        self, pb: Any, request: Any, sender: Any, stream: ResponseStream, scheduler: Scheduler
    ) -> None:
        self.pb, self.request, self.sender, self.stream = pb, request, sender, stream
        self.scheduler = scheduler
        self.seq_id: int | None = None
        self.closed = False

    def tokenized(self, prompt_tokens: int) -> None:
        self.stream.prompt_tokens = prompt_tokens

    def admitted(self, seq_id: int) -> None:
        self.seq_id = seq_id

    def refused(self, error: Exception) -> None:
        if not self.closed:
            self.closed = True
            send_refusal(self.pb, self.sender, error)

    def on_step(self, report: StepReport) -> None:
        if self.closed:
            return
        chunk = self.stream.on_step(report)
        if chunk is not None:
            self.closed = chunk.final
            flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if chunk.final else 0
            self.sender.send(chunk_response(self.pb, chunk), flags=flags)
        if not self.closed and self.seq_id is not None and self.request.is_cancelled():
            self.scheduler.cancel(self.seq_id)  # delivers a final "cancelled" report

    def on_error(self, error: Exception) -> None:
        if not self.closed:
            self.closed = True
            if isinstance(error, RequestTimedOut):
                send_error(self.pb, self.sender, str(error), unavailable(self.pb))
            else:
                message = f"{SERVER_FAILURE}: {error}"
                send_error(self.pb, self.sender, message, self.pb.TritonError.INTERNAL)


def chunk_response(pb: Any, chunk: ResponseChunk) -> Any:
    """The response tensors of one chunk (the entry's outputs, TensorRT-LLM's names)."""

    def int32(value: int) -> np.ndarray:
        return np.array([value], dtype=np.int32)

    text = np.array([chunk.text.encode("utf-8")], dtype=object)
    return pb.InferenceResponse(
        output_tensors=[
            pb.Tensor("text_output", text),
            pb.Tensor("drafted_tokens", int32(chunk.drafted)),
            pb.Tensor("verified_tokens", int32(chunk.verified)),
            pb.Tensor("accepted_tokens", int32(chunk.accepted)),
            pb.Tensor("output_ids", np.array(chunk.output_ids, dtype=np.int32)),
            pb.Tensor("prompt_tokens", int32(chunk.prompt_tokens)),
        ]
    )


def send_refusal(pb: Any, sender: Any, error: Exception) -> None:
    """The final error response of a request that never reached the scheduler."""
    if isinstance(error, RequestError | ValueError):
        send_error(pb, sender, str(error), pb.TritonError.INVALID_ARG)
    elif isinstance(error, Overloaded):
        send_error(pb, sender, str(error), unavailable(pb))
    else:
        message = f"{SERVER_FAILURE}: {type(error).__name__}: {error}"
        send_error(pb, sender, message, pb.TritonError.INTERNAL)


def send_error(pb: Any, sender: Any, message: str, code: Any) -> None:
    error = pb.TritonError(message, code)
    sender.send(pb.InferenceResponse(error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def unavailable(pb: Any) -> Any:
    """UNAVAILABLE (the 2.51 stub has it); INTERNAL keeps an older stub answering."""
    return getattr(pb.TritonError, "UNAVAILABLE", pb.TritonError.INTERNAL)
