"""Speculative decoding on a CUDA device: each algorithm's greedy output equals plain decoding's on the same device
(CUDA graphs on, the engine's default there), seeded sampled output equals plain decoding's tokens, and
``--enable-torch-compile`` (inductor's GPU kernels) keeps outputs; the HTTP server on the GPU is lossless with and
without a JSON-schema grammar; an EAGLE-3 head trained on the GPU drafts losslessly. Float32, tiny random models;
every test needs a GPU and none runs in CPU-only CI (the CPU versions of the same checks live beside the tests)."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs
from tests.speculative.test_ngram_lossless import NGRAM, REPETITIVE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_KW = dict(device="cuda", max_total_tokens=8192)


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _generate(path: str, prompts, params, **kw) -> tuple[list[dict], dict]:
    with Engine(model_path=path, **CUDA_KW, **kw) as e:
        outs = e.generate(prompts, params)
        info = e.get_server_info()
        assert_no_kv_leak(e)
    return outs, info


@pytest.fixture(scope="module")
def deep_target(model_factory):
    return model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)


@pytest.fixture(scope="module")
def deep_head(deep_target, tmp_path_factory):
    return make_eagle3_head_dir(str(tmp_path_factory.mktemp("e3") / "head"), deep_target, kind="self")


def _cases(target, self_head, deep_target, head3):
    return {
        "EAGLE": (target, PROMPTS, spec_kwargs("EAGLE", self_head, 3, 2, 5)),
        "EAGLE3": (deep_target, PROMPTS, spec_kwargs("EAGLE3", head3, 3, 2, 4)),
        "STANDALONE": (deep_target, PROMPTS, spec_kwargs("STANDALONE", deep_target, 3, 1, 4)),
        "NGRAM": (target, REPETITIVE, NGRAM),
    }


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_greedy_speculation_on_gpu_equals_plain(algorithm, target, self_head, deep_target, deep_head):
    path, prompts, kw = _cases(target, self_head, deep_target, deep_head)[algorithm]
    want, _ = _generate(path, prompts, greedy(32))
    outs, info = _generate(path, prompts, greedy(32), disable_speculative_auto_off=True, **kw)
    assert _ids(outs) == _ids(want), algorithm
    assert_drafting_happened(outs, min_accept_length=1.2)
    assert info["cuda_graph"] == "cuda" and info["cuda_graph_replays"] > 0, info


def test_seeded_sampling_on_gpu_equals_plain(target, self_head):
    """A seeded request's sample at each position comes from (seed, position): speculation changes no token."""
    sp = [{"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True, "seed": 11 + i}
          for i in range(4)]
    want, _ = _generate(target, PROMPTS[:4], sp)
    outs, _ = _generate(target, PROMPTS[:4], sp, disable_speculative_auto_off=True,
                        **spec_kwargs("EAGLE", self_head, 3, 2, 5))
    assert _ids(outs) == _ids(want)
    assert_drafting_happened(outs, min_accept_length=1.2)


def test_torch_compile_on_gpu_keeps_outputs(target, self_head):
    want, _ = _generate(target, PROMPTS[:4], greedy(24))
    for kw in ({}, spec_kwargs("EAGLE", self_head, 3, 2, 5)):
        outs, info = _generate(target, PROMPTS[:4], greedy(24), enable_torch_compile=True,
                               disable_speculative_auto_off=True, **kw)
        assert _ids(outs) == _ids(want), kw
        assert info["torch_compile_graphs"] > 0, info


SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta", "gamma"]},
                                           "name": {"type": "string", "maxLength": 10}},
          "required": ["kind", "name"], "additionalProperties": False}


def test_http_server_on_gpu_is_lossless_and_constrained(target, self_head, tmp_path):
    """The HTTP server on the GPU with EAGLE: /generate greedy (free and JSON-schema constrained) equals the plain
    engine's on the GPU, the official client's strict json_schema answer validates, streaming spells the same text."""
    import json

    import jsonschema
    import openai

    from specserve.utils import terminate_process
    from tests.server.conftest import start_server

    free, constrained = greedy(32), greedy(32, json_schema=json.dumps(SCHEMA))
    want_free, _ = _generate(target, PROMPTS[:4], free)
    want_json, _ = _generate(target, PROMPTS[:4], constrained)
    server = start_server(target, str(tmp_path / "server.log"), "--device", "cuda", "--max-total-tokens", "8192",
                          "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", self_head,
                          "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                          "--speculative-num-draft-tokens", "5", "--disable-speculative-auto-off")
    try:
        for params, want in ((free, want_free), (constrained, want_json)):
            outs = server.post("/generate", json={"text": PROMPTS[:4], "sampling_params": params}).json()
            assert _ids(outs) == _ids(want), params
            assert_drafting_happened(outs, min_accept_length=1.1)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
        msg = [{"role": "user", "content": "Pick one."}]
        reply = client.chat.completions.create(model="m", messages=msg, response_format=fmt, temperature=0,
                                               max_tokens=600)  # room for the whitespace the grammar allows
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
        stream = client.chat.completions.create(model="m", messages=msg, response_format=fmt, temperature=0,
                                                max_tokens=600, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == reply.choices[0].message.content
        info = server.info()
        assert info["device"].startswith("cuda") and info["cuda_graph"] == "cuda", info
    finally:
        terminate_process(server.proc)


def test_trainer_on_gpu_writes_a_lossless_head(model_factory, tokenizer_dir, tmp_path):
    """train-eagle on the GPU in bf16 autocast: the head learns, loads on the GPU and drafts losslessly."""
    from transformers import AutoTokenizer

    from specserve.test.tiny import corpus_text
    from specserve.train.eagle import EagleOptions, train_eagle
    from specserve.train.loop import TrainConfig

    bigram = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True,
                           max_position_embeddings=1024)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = torch.tensor(tok(corpus_text(60_000))["input_ids"], dtype=torch.int32)
    cfg = TrainConfig(steps=120, batch_size=8, seq_len=32, lr=2e-2, warmup_steps=10, checkpoint_every=1000,
                      progress=False, bf16=True, device="cuda")
    head = str(tmp_path / "head")
    metrics = train_eagle(bigram, tokens, EagleOptions("EAGLE3", draft_vocab_size=480), cfg, head,
                          dtype=torch.float32)
    assert metrics["acc0"] > 0.5, metrics
    want, _ = _generate(bigram, PROMPTS, greedy(32))
    outs, _ = _generate(bigram, PROMPTS, greedy(32), disable_speculative_auto_off=True,
                        **spec_kwargs("EAGLE3", head, 3, 1, 4))
    assert _ids(outs) == _ids(want)
    assert_drafting_happened(outs, min_accept_length=1.3)
