"""Streaming a character whose UTF-8 bytes are separate tokens, through a model built to emit exactly those tokens:
no chunk carries a partial character or an empty delta, and each token's logprob goes out with the chunk that
completes its character (its "bytes" are the token's own)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from specserve.utils import terminate_process
from tests.server.conftest import start_server
from tests.server.helpers import sse_json

# "é" is C3 A9: in byte-level BPE the pieces "Ã" (0xC3) and "©" (0xA9)
LEAD, TRAIL = "\u00c3", "\u00a9"
N_TOKENS = 8  # "éééé"


@pytest.fixture(scope="module")
def cycle_model(model_factory, tmp_path_factory) -> tuple[str, int, int]:
    """A bigram model (identity layers, unit embeddings) whose LM head maps LEAD -> TRAIL -> LEAD -> ...:
    greedy decoding after TRAIL writes "é" over and over, one byte token at a time."""
    src = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, identity_layers=True)
    out = str(tmp_path_factory.mktemp("utf8") / "model")
    shutil.copytree(src, out)
    tok = AutoTokenizer.from_pretrained(out)
    lead, trail = tok.convert_tokens_to_ids(LEAD), tok.convert_tokens_to_ids(TRAIL)
    assert tok.decode([lead, trail]) == "é" and tok.decode([lead]) == "\ufffd"
    path = os.path.join(out, "model.safetensors")
    weights = load_file(path)
    emb = weights["model.embed_tokens.weight"]
    head = torch.zeros_like(weights["lm_head.weight"])
    head[trail], head[lead] = emb[lead], emb[trail]  # logit of TRAIL after LEAD ~ |e_LEAD|^2, others ~ 0
    weights["lm_head.weight"] = head
    save_file(weights, path, metadata={"format": "pt"})
    return out, lead, trail


@pytest.fixture(scope="module")
def server(cycle_model, tmp_path_factory):
    s = start_server(cycle_model[0], str(tmp_path_factory.mktemp("utf8") / "server.log"))
    yield s
    terminate_process(s.proc)


def _chat_like_prompt(cycle_model) -> list[int]:
    _, lead, trail = cycle_model
    return [5, 7, lead, trail]  # ends on TRAIL: the model continues with LEAD


def test_completion_stream_holds_partial_characters(server, cycle_model):
    body = {"prompt": _chat_like_prompt(cycle_model), "max_tokens": N_TOKENS, "temperature": 0, "stream": True,
            "logprobs": 1, "ignore_eos": True}
    with server.post("/v1/completions", json=body, stream=True) as resp:
        events = sse_json(resp)
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == "é" * (N_TOKENS // 2)
    assert all(t and "\ufffd" not in t for t in texts)  # no empty chunk, no half character
    tokens = [tok for e in events for tok in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == N_TOKENS  # every token's logprob went out, with the chunk completing its character
    for e in events:
        lps = e["choices"][0]["logprobs"]
        assert len(lps["tokens"]) == 2 * len(e["choices"][0]["text"])  # "é" = 2 tokens


def test_chat_stream_logprobs_carry_the_bytes(server, cycle_model):
    _, lead, _ = cycle_model
    # the chat prompt does not end on TRAIL: a +100 bias on LEAD starts the cycle from any token (after LEAD, TRAIL's
    # logit, ~|e|^2 * 4 = 256, still wins)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": N_TOKENS, "temperature": 0,
            "stream": True, "logprobs": True, "top_logprobs": 1, "ignore_eos": True, "logit_bias": {str(lead): 100}}
    with server.post("/v1/chat/completions", json=body, stream=True) as resp:
        events = sse_json(resp)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    middle = [c for c in chunks[1:] if c["finish_reason"] is None]
    assert all(c["delta"].get("content") for c in middle)  # never an empty delta mid-stream
    entries = [x for c in chunks[1:] for x in (c["logprobs"] or {}).get("content", [])]
    assert len(entries) == N_TOKENS
    text = "".join(c["delta"].get("content", "") for c in chunks)
    assert bytes(b for x in entries for b in x["bytes"]).decode() == text  # the tokens' bytes are the text
    assert text == "é" * (N_TOKENS // 2)


def test_generate_stream_is_cumulative_and_whole(server, cycle_model):
    body = {"input_ids": _chat_like_prompt(cycle_model), "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": N_TOKENS - 1, "ignore_eos": True}}
    with server.post("/generate", json=body, stream=True) as resp:
        events = sse_json(resp)
    assert all("\ufffd" not in e["text"] for e in events[:-1])  # a dangling lead byte waits, until the end
    assert events[-1]["text"] == "é" * ((N_TOKENS - 1) // 2) + "\ufffd"  # the last token is a lone lead byte
    assert json.dumps(events[-1]["output_ids"]) == json.dumps([cycle_model[1], cycle_model[2]] * 3 + [cycle_model[1]])
