"""SGLang's finish_reason / ``matched_stop`` tests (``test/registered/openai_server/validation/test_matched_stop.py``,
which mixes in ``sglang.test.kits.matched_stop_kit.MatchedStopMixin``), ported to a real specserve server on CPU
with the tiny random Llama, through the official ``openai`` client.

Launched as SGLang launches it (``--max-running-requests 10``). SGLang's checks, per request: ``finish_reason`` and
``choices[0].matched_stop`` -- the stop string itself for a stop string, the integer token id for EOS / a stop
token, and null (the key present) for a length finish.

Adaptations to a random model, which neither follows instructions nor ends its answers:
- The model's context is 2048 positions, so SGLang's ``max_tokens=1000`` after the long story prompt still fits.
- A stop string only fires if the model writes it: ``check_newline_reference`` first runs each prompt without the
  stop and fails loudly (never skips) if the greedy text holds no "\\n". For chat, SGLang's own story prompt does;
  for completions the story prompt alone never does, so the completion tests send the chat-template rendering
  of the same conversation as a raw prompt (as SGLang's EOS test sends a raw Llama-3 formatted prompt).
- A random model practically never samples EOS by itself: the EOS tests give EOS a +100 ``logit_bias`` and
  ``min_tokens=4``, so the first four tokens are the plain greedy ones (a stop token is masked before
  min_tokens) and the fifth is EOS.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests
import transformers

from specserve.utils import terminate_process
from tests.server.conftest import start_server

CONTEXT = 2048

# The prompt of SGLang's kit (MANY_NEW_TOKENS_PROMPT): a request for a very long story.
STORY_PROMPT = """
Please write an extremely detailed and vivid fantasy story, set in a world full of intricate magic systems, political intrigue, and complex characters.
Ensure that you thoroughly describe every scene, character's motivations, and the environment. Include long, engaging dialogues and elaborate on the inner thoughts of the characters.
Each section should be as comprehensive as possible to create a rich and immersive experience for the reader.
The story should span multiple events, challenges, and character developments over time. Aim to make the story at least 3,000 words long.
"""  # noqa: E501
SYSTEM = "You are a helpful AI assistant"
EOS_PROMPT = "What is 2 + 2?"
MIN_BEFORE_EOS = 4


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, str(tmp_path_factory.mktemp("matched-stop") / "server.log"),
                     "--max-running-requests", "10")
    yield s
    terminate_process(s.proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def eos_id(tokenizer, model_dir) -> int:
    """The model's EOS id, as the model folder declares it (config.json and the tokenizer agree on it)."""
    with open(f"{model_dir}/config.json") as f:
        declared = json.load(f)["eos_token_id"]
    assert tokenizer.eos_token_id == declared and isinstance(declared, int)
    return declared


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def raw_chat_prompt(tokenizer, user: str) -> str:
    """The conversation [system, user] rendered by the model's chat template, as one raw completion prompt."""
    return tokenizer.apply_chat_template(messages(user), tokenize=False, add_generation_prompt=True)


def run(client, server, endpoint: str, prompt: str, max_tokens: int, **extra):
    """One greedy request as the kit sends it (temperature 0, top_p 1) -> (choice, its text, the response)."""
    common = dict(model=server.model, temperature=0, top_p=1, max_tokens=max_tokens, extra_body=extra or None)
    if endpoint == "completions":
        out = client.completions.create(prompt=prompt, **common)
        return out.choices[0], out.choices[0].text, out
    out = client.chat.completions.create(messages=messages(prompt), **common)
    return out.choices[0], out.choices[0].message.content, out


def matched_stop(choice):
    extra = choice.model_extra or {}
    assert "matched_stop" in extra, f"no matched_stop key in the choice: {choice}"
    return extra["matched_stop"]


def story_prompt(endpoint: str, tokenizer) -> str:
    """The story prompt as each endpoint gets it (see the module docstring)."""
    return raw_chat_prompt(tokenizer, STORY_PROMPT) if endpoint == "completions" else STORY_PROMPT


def check_newline_reference(client, server, endpoint: str, prompt: str) -> str:
    _, text, _ = run(client, server, endpoint, prompt, 64)
    assert "\n" in text, f"precondition: the tiny model's greedy {endpoint} output has no newline: {text!r}"
    return text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_finish_stop_str(client, server, tokenizer, endpoint):
    """Ports MatchedStopMixin.test_finish_stop_str: stop="\\n", max_tokens=1000 -> finish_reason "stop" and
    matched_stop "\\n" (the stop string itself); the text is cut before the stop string (SGLang trims it)."""
    prompt = story_prompt(endpoint, tokenizer)
    reference = check_newline_reference(client, server, endpoint, prompt)
    choice, text, _ = run(client, server, endpoint, prompt, 1000, stop="\n")
    assert choice.finish_reason == "stop"
    assert matched_stop(choice) == "\n"
    assert text == reference[:reference.index("\n")]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_finish_stop_str_streaming(client, server, tokenizer, endpoint):
    """Ports MatchedStopMixin.test_finish_stop_str to streaming (SGLang's stream chunks carry matched_stop too):
    the one chunk with a finish_reason says "stop" with matched_stop "\\n", and the streamed text equals the
    non-streamed one."""
    prompt = story_prompt(endpoint, tokenizer)
    check_newline_reference(client, server, endpoint, prompt)
    _, full_text, _ = run(client, server, endpoint, prompt, 1000, stop="\n")
    kw = dict(model=server.model, temperature=0, top_p=1, max_tokens=1000, stop="\n", stream=True)
    if endpoint == "completions":
        chunks = list(client.completions.create(prompt=prompt, **kw))
        pieces = [c.choices[0].text for c in chunks if c.choices]
    else:
        chunks = list(client.chat.completions.create(messages=messages(prompt), **kw))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finishing = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    assert finishing[0].finish_reason == "stop"
    assert matched_stop(finishing[0]) == "\n"
    assert "".join(pieces) == full_text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_no_stop_trim_keeps_stop_string(client, server, tokenizer, endpoint):
    """Ports SGLang's no_stop_trim (the stop trimming MatchedStopMixin.test_finish_stop_str relies on): with
    no_stop_trim the stop string stays in the text, which is then the greedy text up to and past the "\\n"."""
    prompt = story_prompt(endpoint, tokenizer)
    reference = check_newline_reference(client, server, endpoint, prompt)
    choice, text, _ = run(client, server, endpoint, prompt, 1000, stop="\n", no_stop_trim=True)
    assert choice.finish_reason == "stop"
    assert matched_stop(choice) == "\n"
    cut = reference.index("\n")
    assert text.startswith(reference[:cut + 1]) and reference.startswith(text)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_finish_stop_regex_str(client, server, tokenizer, endpoint):
    """Ports MatchedStopMixin.test_finish_stop_regex_str: an alternation stop_regex (both endpoints) and the
    sentence end "[.!?]\\s*$" (chat), max_tokens=1000 -> finish_reason "stop" and matched_stop the pattern itself.
    SGLang's alternation is "and|or"; a random model need not write either, so where its greedy reference has
    neither, the alternation is of two pieces of that reference. The text is cut where the match starts (as a stop
    string is cut; SGLang leaves it in)."""
    prompt = story_prompt(endpoint, tokenizer)
    _, reference, _ = run(client, server, endpoint, prompt, 1000)
    alternation = r"and|or" if re.search(r"and|or", reference) else "|".join(
        re.escape(reference[k:k + 3]) for k in (40, 20))
    first = re.search(alternation, reference)
    choice, text, _ = run(client, server, endpoint, prompt, 1000, stop_regex=alternation)
    assert (choice.finish_reason, matched_stop(choice), text) == ("stop", alternation, reference[:first.start()])
    if endpoint == "chat":
        sentence = r"[.!?]\s*$"
        assert re.search(r"[.!?]", reference), f"precondition: no sentence end mark in {reference!r}"
        choice, text, _ = run(client, server, endpoint, prompt, 1000, stop_regex=sentence)
        assert (choice.finish_reason, matched_stop(choice)) == ("stop", sentence)
        assert reference.startswith(text) and reference[len(text)] in ".!?"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_finish_stop_eos(client, server, tokenizer, eos_id, endpoint):
    """Ports MatchedStopMixin.test_finish_stop_eos: a request that ends on EOS -> finish_reason "stop" and
    matched_stop the integer EOS id (SGLang: one of Llama-3's [128000, 128009, 2]; here the tiny model's EOS).
    EOS is made the greedy choice with logit_bias; min_tokens=4 holds it back for four tokens."""
    prompt = raw_chat_prompt(tokenizer, EOS_PROMPT) if endpoint == "completions" else EOS_PROMPT
    choice, _, out = run(client, server, endpoint, prompt, 1000, logit_bias={str(eos_id): 100},
                         min_tokens=MIN_BEFORE_EOS)
    assert choice.finish_reason == "stop"
    got = matched_stop(choice)
    assert got == eos_id and isinstance(got, int)
    assert out.usage.completion_tokens == MIN_BEFORE_EOS + 1  # the EOS token counts as generated


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_eos_text_trimmed_even_with_special_tokens(client, server, tokenizer, eos_id, endpoint):
    """Ports SGLang's stop trimming behind MatchedStopMixin.test_finish_stop_eos: a matched stop token is dropped
    before detokenizing, so with skip_special_tokens=False the EOS text ("<|eos|>") still does not appear; with
    no_stop_trim=True it does."""
    prompt = raw_chat_prompt(tokenizer, EOS_PROMPT) if endpoint == "completions" else EOS_PROMPT
    eos_text = tokenizer.convert_ids_to_tokens(eos_id)
    _, before_eos, _ = run(client, server, endpoint, prompt, MIN_BEFORE_EOS, skip_special_tokens=False)
    bias = dict(logit_bias={str(eos_id): 100}, min_tokens=MIN_BEFORE_EOS, skip_special_tokens=False)

    choice, text, _ = run(client, server, endpoint, prompt, 1000, **bias)
    assert choice.finish_reason == "stop" and matched_stop(choice) == eos_id
    assert eos_text not in text
    assert text == before_eos

    choice, text, _ = run(client, server, endpoint, prompt, 1000, no_stop_trim=True, **bias)
    assert choice.finish_reason == "stop" and matched_stop(choice) == eos_id
    assert text == before_eos + eos_text


def test_stop_token_ids_matched(client, server, tokenizer):
    """Ports MatchedStopMixin.test_finish_stop_eos to SGLang's stop_token_ids (the same int-matched path): a stop
    token the model really emits ends the request with matched_stop that id, and its text is trimmed."""
    prompt = raw_chat_prompt(tokenizer, EOS_PROMPT)
    r = requests.post(server.url + "/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    assert r.status_code == 200, r.text
    ids = r.json()["output_ids"]
    specials = set(tokenizer.all_special_ids)
    # the first position >= 2 whose token is new (so it is not matched earlier) and not a special token
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and ids[i] not in specials)
    _, first_k, _ = run(client, server, "completions", prompt, k)

    choice, text, out = run(client, server, "completions", prompt, 1000, stop_token_ids=[ids[k]])
    assert choice.finish_reason == "stop"
    got = matched_stop(choice)
    assert got == ids[k] and isinstance(got, int)
    assert out.usage.completion_tokens == k + 1
    assert text == first_k


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_finish_length(client, server, endpoint):
    """Ports MatchedStopMixin.test_finish_length: max_tokens=5 -> finish_reason "length" and matched_stop null
    (the key present)."""
    choice, _, out = run(client, server, endpoint, STORY_PROMPT, 5)
    assert choice.finish_reason == "length"
    assert matched_stop(choice) is None
    assert out.usage.completion_tokens == 5
