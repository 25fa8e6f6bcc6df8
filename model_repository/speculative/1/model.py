"""Entry point: text in, text out (decoupled), with in-flight batching of all live requests.

execute() only checks each request's inputs (no tokenizing) and hands it to an
avspec.serving.entry.EntryIntake, whose workers tokenize it and submit it to one
avspec.engine.scheduler.Scheduler; the scheduler's background thread runs one BLS call of the
`speculative_step` ensemble per decode step for the whole batch and sends each request's
responses (avspec.serving.requests.ResponseStream). A full wait queue answers UNAVAILABLE (HTTP
503), so the client retries later; so does a request that ran past `request_timeout_s`.
"""

import json
import secrets

import numpy as np
import triton_python_backend_utils as pb_utils

from avspec.engine.admission import Overloaded
from avspec.engine.scheduler import RequestTimedOut
from avspec.serving import repository
from avspec.serving.entry import EntryIntake, entry_scheduler, stage_limits
from avspec.serving.metrics import LIVE_SEQUENCES
from avspec.serving.requests import (
    RequestError,
    ResponseStream,
    entry_tokenizer,
    parse_client,
)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.params = repository.parse_parameters(
            repository.EntryParams, repository.model_parameters(config)
        )
        self.input_names = [tensor["name"] for tensor in config["input"]]
        # the target model's tokenizer (the tokenizer.json of its model_dir)
        self.tokenizer = entry_tokenizer(args["model_repository"])
        self.live_family = pb_utils.MetricFamily(
            name=LIVE_SEQUENCES.name,
            description=LIVE_SEQUENCES.description,
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.live = self.live_family.Metric(labels={})
        self.live.set(0)
        p = self.params
        self.scheduler = entry_scheduler(
            self._step, self.tokenizer.eos_ids, p, stage_limits(args["model_repository"]),
            # ids never seen before: a restarted entry must not continue a dead one's sequences
            first_seq_id=secrets.randbits(61) + 1,
        )  # fmt: skip
        self.intake = EntryIntake(self.scheduler, self.tokenizer, p)
        self.scheduler.start()
        self.intake.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                values = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    values[name] = None if tensor is None else tensor.as_numpy()
                identity = parse_client(request.parameters())
                prompt = self.intake.check(values, identity)  # refuses, never tokenizes
                client = _Client(request, sender, ResponseStream(prompt.stream, self.tokenizer))
                client.scheduler = self.scheduler
                self.intake.submit(prompt, client)  # tokenized and submitted by its workers
            except Exception as err:  # noqa: BLE001 - never leave a stream open
                _send_refusal(sender, err)
        return None

    def finalize(self):
        self.intake.stop(timeout_s=10)
        self.scheduler.stop(timeout_s=10)

    def _step(self, inputs):
        """The scheduler's step function: one BLS call of the step ensemble for the batch."""
        self.live.set(self.scheduler.live_count)
        arrays = repository.step_inputs_to_numpy(inputs)
        response = pb_utils.InferenceRequest(
            model_name=self.params.step_model,
            inputs=[pb_utils.Tensor(name, value) for name, value in arrays.items()],
            requested_output_names=list(repository.STEP_OUTPUT_DTYPES),
        ).exec()
        if response.has_error():
            raise RuntimeError(f"{self.params.step_model}: {response.error().message()}")
        outputs = {
            name: pb_utils.get_output_tensor_by_name(response, name).as_numpy()
            for name in repository.STEP_OUTPUT_DTYPES
        }
        return repository.step_outputs_from_numpy(outputs)


class _Client:
    """One request's response sender (an avspec.serving.entry.RequestSink), fed by the intake's
    workers and the scheduler thread."""

    def __init__(self, request, sender, stream):
        self.request, self.sender, self.stream = request, sender, stream
        self.scheduler = None
        self.seq_id = None
        self.closed = False

    def admitted(self, seq_id):
        self.seq_id = seq_id

    def refused(self, error):
        if not self.closed:
            self.closed = True
            _send_refusal(self.sender, error)

    def on_step(self, report):
        if self.closed:
            return
        chunk = self.stream.on_step(report)
        if chunk is not None:
            self.closed = chunk.final
            self.sender.send(_chunk_response(chunk), flags=_final() if chunk.final else 0)
        if not self.closed and self.seq_id is not None and self.request.is_cancelled():
            self.scheduler.cancel(self.seq_id)  # delivers a final "cancelled" report

    def on_error(self, error):
        if not self.closed:
            self.closed = True
            if isinstance(error, RequestTimedOut):
                _send_error(self.sender, str(error), _unavailable())
            else:
                message = f"generation failed: {error}"
                _send_error(self.sender, message, pb_utils.TritonError.INTERNAL)


def _chunk_response(chunk):
    def int32(value):
        return np.array([value], dtype=np.int32)

    text = np.array([chunk.text.encode("utf-8")], dtype=object)
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", text),
            pb_utils.Tensor("drafted_tokens", int32(chunk.drafted)),
            pb_utils.Tensor("verified_tokens", int32(chunk.verified)),
            pb_utils.Tensor("accepted_tokens", int32(chunk.accepted)),
            pb_utils.Tensor("output_ids", np.array(chunk.output_ids, dtype=np.int32)),
        ]
    )


def _send_refusal(sender, error):
    """The final error response of a request that never reached the scheduler."""
    if isinstance(error, RequestError | ValueError):
        _send_error(sender, str(error), pb_utils.TritonError.INVALID_ARG)
    elif isinstance(error, Overloaded):
        _send_error(sender, str(error), _unavailable())
    else:
        # the prefix tells the front it is the server's failure (5xx): Triton 2.51 answers 400
        # to every error of a decoupled model (avspec.serving.front.http_wire)
        message = f"generation failed: {type(error).__name__}: {error}"
        _send_error(sender, message, pb_utils.TritonError.INTERNAL)


def _send_error(sender, message, code):
    error = pb_utils.TritonError(message, code)
    sender.send(pb_utils.InferenceResponse(error=error), flags=_final())


def _unavailable():
    # UNAVAILABLE is in the 2.51 stub; INTERNAL keeps an older stub answering.
    return getattr(pb_utils.TritonError, "UNAVAILABLE", pb_utils.TritonError.INTERNAL)


def _final():
    # Read at call time: the auto-complete pass imports this file before pb_utils is complete.
    return pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
