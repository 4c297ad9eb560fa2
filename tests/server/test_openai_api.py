"""The OpenAI-compatible endpoints through the official `openai` client (and raw SSE where the client hides it)."""

from __future__ import annotations

import math

import pytest
import transformers

from tests.server.conftest import CONTEXT
from tests.server.helpers import GREEDY, sse_json

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three primes."}]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def tokenizer(server_model):
    return transformers.AutoTokenizer.from_pretrained(server_model)


def chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].max_model_len == CONTEXT


def test_chat_stream_equals_non_stream_greedy(client, server, tokenizer):
    kw = dict(model=server.model, messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and len(full.choices) == 1
    assert full.choices[0].finish_reason == "length" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    u = usage_chunks[0].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1  # the repeat hit the prefix cache
    assert all(c.id == chunks[0].id for c in chunks)


def test_completions_stream_equals_non_stream_greedy(client, server, tokenizer):
    kw = dict(model=server.model, prompt=PROMPT, temperature=0, max_tokens=20, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12}),
])
def test_raw_sse_done_is_last_and_usage_only_at_the_end(server, path, body):
    body = {**body, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    with server.post(path, json=body, stream=True) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_json(resp)
    assert sum(1 for e in events for c in e["choices"] if c["finish_reason"] is not None) == 1
    assert [e["usage"] is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_n2_gives_two_seeded_choices(client, server):
    kw = dict(model=server.model, messages=MESSAGES, temperature=1.0, max_tokens=16, n=2, seed=123,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert a.usage.completion_tokens == 32
    streamed = list(client.chat.completions.create(**kw, stream=True))
    texts = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
        finishes[c.choices[0].index] += c.choices[0].finish_reason is not None
    assert finishes == {0: 1, 1: 1}
    assert [texts[0], texts[1]] == [c.message.content for c in a.choices]


def test_completions_batch_prompts_and_token_ids(client, server, tokenizer):
    ids = tokenizer.encode("x = 1")
    out = client.completions.create(model=server.model, prompt=[PROMPT, "x = 1"], max_tokens=6, temperature=0,
                                    n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: the two samples of a prompt agree
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == out.choices[2].text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(ids)  # each prompt counted once
    assert out.usage.completion_tokens == 24


def test_chat_logprobs_consistent(client, server):
    kw = dict(model=server.model, messages=MESSAGES, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 10
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.token == tops[0].token and entry.logprob == pytest.approx(tops[0].logprob)  # greedy = argmax
        assert entry.logprob <= 0 and sum(math.exp(t.logprob) for t in tops) <= 1 + 1e-5
    streamed = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs]
    flat = [e for c in streamed for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in flat] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_and_offsets(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                    echo=False, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(max(top.values()) == pytest.approx(v) for top, v in pairs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_echo_prepends_the_prompt(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_stop_string_cuts_and_is_reported(client, server):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[10:13]
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra.get("matched_stop") == stop


def test_max_completion_tokens_wins_and_logit_bias_applies(client, server, tokenizer):
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=50,
                                         max_completion_tokens=3, temperature=0, logit_bias={"65": 100},
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert out.choices[0].message.content == tokenizer.decode([65, 65, 65])


def test_sglang_extras_top_k_1_is_greedy(client, server):
    greedy = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    topk1 = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=5,
                                      extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert topk1.choices[0].text == greedy.choices[0].text


def test_continuous_usage_stats_report_every_chunk(server):
    body = {"prompt": PROMPT, "max_tokens": 10, "stream": True, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with server.post("/v1/completions", json=body, stream=True) as resp:
        events = sse_json(resp)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 10 and counts[0] >= 1
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + c for e, c in zip(events, counts,
                                                                                             strict=True))
