"""front.openai.generation: the entry's decode steps as text, cut at stop strings and max_tokens,
with exact usage and the speculative figures, through `/v1/completions` with the official
`openai` client against a fake entry.

The fake streams decode steps as the entry does (helpers.front_fakes.blocks: accepted drafts
then one target token per step, one byte-tokenizer token per character), so stop strings can be
placed across and inside blocks. The same routes against the real server:
tests/serving/test_openai.py.
"""

from __future__ import annotations

import json

from helpers.clients import MODEL
from helpers.hf_dirs import byte_tokenizer


def prompt_tokens(text: str) -> int:
    return len(byte_tokenizer().encode(text).ids)


def test_completion_text_usage_and_speculative_figures(client, fake_http):
    prompt = "blocks:ab,cde,f|"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == ("abcdef", "stop")  # the entry ended: EOS
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens == prompt_tokens(prompt)
    assert response.usage.total_tokens == prompt_tokens(prompt) + 6
    assert response.speculative == {
        "drafted_tokens": 3 + 4 + 2,
        "verified_tokens": 2 + 3 + 1,
        "accepted_tokens": 1 + 2 + 0,
        "steps": 3,
    }
    (seen,) = fake_http.requests
    assert seen.path == "/v2/models/speculative/generate_stream"
    sent = json.loads(seen.body)
    assert sent["avspec-client"] == "127.0.0.1" and sent["stream"] is True  # identity, as /v2
    assert (sent["text_input"], sent["max_tokens"]) == (prompt, 16)


def test_stop_string_split_across_blocks(client):
    response = client.completions.create(
        model=MODEL, prompt="blocks:abX,Ycd,ef|", max_tokens=16, stop=["XY", "zz"]
    )
    assert (response.choices[0].text, response.choices[0].finish_reason) == ("ab", "stop")
    # a, b, X, Y: the block "Ycd" completes the stop with its first token; c and d not counted
    assert response.usage.completion_tokens == 4


def test_stop_string_inside_one_accepted_block(client):
    response = client.completions.create(
        model=MODEL, prompt="blocks:ab,cSTOPde,f|", max_tokens=16, stop="STOP"
    )
    assert response.choices[0].text == "abc"
    assert response.usage.completion_tokens == 2 + 5  # up to the P of STOP, not d and e


def test_stop_is_held_back_while_streaming_and_never_sent(client):
    stream = client.completions.create(
        model=MODEL, prompt="blocks:aS,TO,Pz|", max_tokens=16, stop="STOP", stream=True
    )
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(texts) == "a" and not any("S" in text for text in texts)


def test_max_tokens_inside_a_block_is_length_with_exact_usage(client):
    response = client.completions.create(model=MODEL, prompt="blocks:ab,cdefg,h|", max_tokens=4)
    assert (response.choices[0].text, response.choices[0].finish_reason) == ("abcd", "length")
    assert response.usage.completion_tokens == 4
