"""front.openai.chat_template: the pair's chat template renders the text transformers'
`apply_chat_template` renders, sandboxed."""

from __future__ import annotations

import json

import pytest
from helpers.hf_dirs import BOS, EOS, tiny_tokenizer
from transformers import AutoTokenizer

from avspec.serving.front.openai.chat_template import ChatTemplate, ChatTemplateError

# The shapes of the template families in use (ChatML with a default system prompt as Qwen2.5,
# Llama 3 headers with BOS, Mistral's alternation check, and one with tojson, loop controls,
# a generation block and strftime_now), written as their tokenizer_config.json carry them.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
FEATURES = """{% set today = strftime_now("%Y-%m-%d") %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {{ m.role }}: {{ m.content | tojson }} ({{ today }})
    {% if m.role == 'assistant' %}
{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": 'What is 2+2? <b>\u00e9\u00e8</b> "quoted"'},
    {"role": "assistant", "content": "  4  "},
    {"role": "user", "content": "And 3+3?"},
]


def pair_directory(tmp_path, template):
    tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("template", [CHATML, LLAMA3, FEATURES])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_same_text_as_transformers(tmp_path, template, generation_prompt):
    directory = pair_directory(tmp_path, template)
    reference = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt
    )
    ours = ChatTemplate.from_directory(directory).render(CONVERSATION, generation_prompt)
    assert ours == reference


def test_mistral_alternation_and_its_refusal(tmp_path):
    directory = pair_directory(tmp_path, MISTRAL)
    turns = CONVERSATION[1:]
    reference = AutoTokenizer.from_pretrained(directory).apply_chat_template(turns, tokenize=False)
    assert ChatTemplate.from_directory(directory).render(turns, False) == reference
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate.from_directory(directory).render(CONVERSATION)


def test_named_templates_use_the_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    directory = pair_directory(tmp_path, named)
    rendered = ChatTemplate.from_directory(directory).render(CONVERSATION[1:2])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_a_template_file_wins_over_the_config(tmp_path):
    directory = pair_directory(tmp_path, CHATML)
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert ChatTemplate.from_directory(directory).render(CONVERSATION) == "Answer in one line."


def test_no_template_is_none(tmp_path):
    directory = pair_directory(tmp_path, None)
    assert ChatTemplate.from_directory(directory) is None


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",  # reaching Python's objects
        "{{ ''.__class__.__subclasses__() }}",
        "{% set _ = messages.append(1) %}{{ messages | length }}",  # mutating the input
        "{{ raise_exception('no') }}",
    ],
)
def test_the_sandbox_refuses(tmp_path, template):
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_directory(pair_directory(tmp_path, template)).render(CONVERSATION)


def test_a_broken_template_fails_at_load(tmp_path):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_directory(pair_directory(tmp_path, "{% for %}"))
