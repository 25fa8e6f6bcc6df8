"""The real server on a user's pair: a tiny Hugging Face Llama target and draft + tokenizer.json.

A module-scoped server of its own, over the repository copy the launcher builds for
`--draft-model/--target-model` (`avspec.serving.host.model_pair`: model_dir, vocab_limit, the
caps at max_position_embeddings, pair_id), the estimator snapshot in tmp. Greedy output over
HTTP must equal transformers' greedy `generate` of the target, decoded by the same tokenizer;
streamed chunks must join to the same text. A pair whose tokenizers differ in one token fails
the launcher before tritonserver starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

pytest.importorskip("transformers")

from helpers import ROOT  # noqa: E402
from helpers.clients import http_generate, http_generate_stream  # noqa: E402
from helpers.hf_dirs import (  # noqa: E402
    hf_greedy,
    perturbed,
    save_hf_dir,
    tiny_llama,
    tiny_tokenizer,
)

from avspec.runtime.model_dir import load_tokenizer  # noqa: E402
from avspec.serving.host import launcher  # noqa: E402
from avspec.serving.host.model_pair import prepare_pair, shared_pool_overrides  # noqa: E402
from avspec.serving.host.server_process import ServerProcess, free_port  # noqa: E402
from avspec.serving.host.settings import (  # noqa: E402
    ModelSettings,
    NetworkSettings,
    ServeSettings,
    TritonSettings,
)
from avspec.serving.repository import copy_repository  # noqa: E402

pytestmark = pytest.mark.serving

MAX_NEW = 24
# the third is prefilled in pieces (the entry's prefill_chunk, 128 tokens)
PROMPTS = ("The quick brown fox", "def add(a, b):", "A long prompt, over many steps. " * 20)
CONTEXT = 8192
LONG = 4096  # max_tokens of one request: past the 512 positions a sequence had before
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory: pytest.TempPathFactory):
    """(server, the transformers target, draft dir, target dir)."""
    tmp = tmp_path_factory.mktemp("hf_serving")
    tok = tiny_tokenizer()
    # padded rows: vocab_limit masks them; a context of 8,192 positions, as SmolLM2's
    target = tiny_llama(tok.get_vocab_size() + 8, seed=21, max_positions=CONTEXT)
    draft = perturbed(target, 0.08, seed=22)
    eos = [tok.token_to_id("</s>")]
    target_dir = save_hf_dir(tmp / "target", target, tok, generation_eos=eos)
    draft_dir = save_hf_dir(tmp / "draft", draft, tok, generation_eos=eos)
    for directory in (target_dir, draft_dir):  # the chat route needs a template
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = CHATML
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    repository = ROOT / "model_repository"
    pair = prepare_pair(repository, draft_dir, target_dir)
    overrides = {stage: dict(values) for stage, values in pair.overrides.items()}
    for stage in ("draft", "target"):  # against transformers' float32 (the repository: auto)
        overrides.setdefault(stage, {}).update(dtype="float32", engine="torch")
    pool_lines = shared_pool_overrides(repository, pair, overrides)  # as the launcher does
    assert any("target on torch: one KV pool" in line for line in pool_lines), pool_lines
    overrides["verifier"] = {
        **overrides.get("verifier", {}),
        "snapshot_path": str(tmp / "estimator_snapshot.json"),
    }
    copy = copy_repository(repository, tmp / "model_repository", overrides)
    log = tmp / "tritonserver.log"
    process = ServerProcess(
        ServeSettings(
            ModelSettings((copy,)),
            NetworkSettings(free_port(), free_port(), free_port()),
            TritonSettings(exit_timeout_s=5, log_path=log),
        )
    )
    try:
        process.start()
    except Exception:
        print(log.read_text()[-6000:])
        raise
    yield process, target, draft_dir, target_dir
    process.stop()


def transformers_greedy_text(model, directory: Path, prompt: str) -> str:
    tokenizer = load_tokenizer(directory)
    # the padded embedding rows are not tokens: masked like the server's vocab_limit
    padded = list(range(tokenizer.vocab_size, model.config.vocab_size))
    out = hf_greedy(
        model, tokenizer.encode(prompt), sorted(tokenizer.eos_ids), MAX_NEW, suppress=padded
    )
    return tokenizer.decode(out)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_http_equals_transformers(hf_server, prompt: str) -> None:
    server, target, _, target_dir = hf_server
    want = transformers_greedy_text(target, target_dir, prompt)
    assert prompt is not PROMPTS[2] or len(load_tokenizer(target_dir).encode(prompt)) > 2 * 128
    got = http_generate(server.http_url, text_input=prompt, max_tokens=MAX_NEW, temperature=0.0)
    assert got.text == want
    assert got.drafted > 0 and 0 <= got.accepted <= got.verified <= got.drafted


def test_streaming_chunks_join_to_the_same_text(hf_server) -> None:
    server, target, _, target_dir = hf_server
    prompt = PROMPTS[0]
    events = http_generate_stream(
        server.http_url, text_input=prompt, max_tokens=MAX_NEW, temperature=0.0
    )
    assert all("error" not in e for e in events), events
    assert len(events) > 1
    text = "".join(e["text_output"] for e in events)
    assert text == transformers_greedy_text(target, target_dir, prompt)


def test_bad_pair_fails_the_launcher_naming_both_directories(
    hf_server, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import json
    import shutil

    _, _, draft_dir, target_dir = hf_server
    bad = Path(shutil.copytree(draft_dir, tmp_path / "bad_draft"))
    data = json.loads((bad / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["<renamed>"] = vocab.pop("\u0100")  # byte 0x00: in no merge of the tiny corpus
    (bad / "tokenizer.json").write_text(json.dumps(data))
    argv = ["--model-repository", str(ROOT / "model_repository")]
    code = launcher.main([*argv, "--draft-model", str(bad), "--target-model", str(target_dir)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"draft {bad.resolve()} and target {target_dir.resolve()}" in err
    assert "do not share a vocabulary: token id" in err


def test_a_chat_request_may_use_the_models_own_context(hf_server) -> None:
    """max_tokens 4,096 (refused before: a sequence had 512 positions) is accepted and runs
    until the model ends its turn or reaches 4,096 tokens, over the torch runtime's shared
    KV pool; a request past the context is refused naming the limit."""
    server = hf_server[0]
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0) as client:
        answer = client.chat.completions.create(
            model="speculative",
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=LONG,
            temperature=0,
            timeout=600,
        )
        usage, finish = answer.usage, answer.choices[0].finish_reason
        print(f"{usage.completion_tokens} tokens, finish_reason {finish}")
        assert (finish, usage.completion_tokens) == ("length", LONG) or finish == "stop"
        with pytest.raises(openai.BadRequestError, match=f"{CONTEXT:,}|{CONTEXT}"):
            client.chat.completions.create(
                model="speculative",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=CONTEXT,
            )
