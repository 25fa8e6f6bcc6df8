"""The TensorRT-LLM target's Triton model (avspec.serving.stages.trtllm_model) against a stand-in
for `triton_python_backend_utils`: one BLS request per sequence with its tensors (draft_logits
through DLPack), the engine's outputs read back in order, an engine error named. Never run on a
GPU."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from avspec.serving.stages.trtllm_model import TrtllmTargetModel
from avspec.trtllm.request import TRTLLM_OUTPUTS, TargetRequest


class Tensor:
    def __init__(self, name: str, value) -> None:
        self.name, self.value = name, value

    @classmethod
    def from_dlpack(cls, name: str, capsule) -> Tensor:
        return cls(name, torch.utils.dlpack.from_dlpack(capsule))

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self) -> np.ndarray:
        return np.asarray(self.value)


class Engine:
    """Answers output i with [i + 1, i + 1]; or fails with `error`."""

    def __init__(self, error: str | None = None) -> None:
        self.error, self.sent = error, []

    def request(self, model_name: str, inputs: list, requested_output_names: list):
        engine = self

        class Request:
            async def async_exec(self):
                engine.sent.append((model_name, {t.name: t.value for t in inputs}))
                outputs = {n: Tensor(n, np.full(2, i + 1))
                           for i, n in enumerate(requested_output_names)}  # fmt: skip
                message = SimpleNamespace(message=lambda: engine.error)
                return SimpleNamespace(
                    has_error=lambda: engine.error is not None,
                    error=lambda: message,
                    outputs=outputs,
                )

        return Request()


def model(engine: Engine) -> TrtllmTargetModel:
    pb = SimpleNamespace(
        Tensor=Tensor,
        InferenceRequest=engine.request,
        get_output_tensor_by_name=lambda response, name: response.outputs[name],
    )
    built = type("Model", (TrtllmTargetModel,), {"pb": pb})()
    built.params = SimpleNamespace(trtllm_model="tensorrt_llm")
    return built


def prepared(logits: torch.Tensor | None) -> TargetRequest:
    host = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32)}
    return TargetRequest(seq_id=1, host=host, draft_logits=logits, drafts=[7])


def test_one_request_per_sequence_with_its_tensors_and_outputs_in_order() -> None:
    engine = Engine()
    logits = torch.log_softmax(torch.randn(1, 1, 5), -1)
    answer = asyncio.run(model(engine).send(prepared(logits)))
    assert [a.tolist() for a in answer] == [[i + 1] * 2 for i in range(len(TRTLLM_OUTPUTS))]
    ((name, sent),) = engine.sent
    assert name == "tensorrt_llm" and sent["input_ids"].tolist() == [[5, 6, 7]]
    assert torch.equal(sent["draft_logits"], logits)
    asyncio.run(model(engine).send(prepared(None)))
    assert "draft_logits" not in engine.sent[-1][1]


def test_an_engine_error_names_the_engine_model() -> None:
    with pytest.raises(RuntimeError, match="tensorrt_llm: out of KV blocks"):
        asyncio.run(model(Engine("out of KV blocks")).send(prepared(None)))
