"""SGLang's native-API server tests (``test/registered/core/test_srt_endpoint.py`` and its helper
``run_logprob_check`` from ``sglang/test/test_utils.py``), ported to a real specserve server on CPU.

The server is started the way SGLang's test starts its own (``--mem-fraction-static 0.7 --cuda-graph-max-bs 8``,
accepted here as no-ops on CPU), with a tiny random Llama (512-token vocabulary and context) in float32 so logprobs
can be compared tightly. Lengths, token ids and prompts are scaled to that model; the assertions are SGLang's.
``--enable-custom-logit-processor`` is not passed: specserve has no such flag and refuses custom logit processors
(see test_custom_logit_processor_is_refused).
"""

from __future__ import annotations

import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.utils import terminate_process
from tests.server.conftest import start_server

# SGLang's launch flags for TestSRTEndpoint (its CUDA-graph and memory flags are no-ops on CPU), plus CPU/float32.
SGLANG_TEST_FLAGS = ("--mem-fraction-static", "0.7", "--cuda-graph-max-bs", "8", "--device", "cpu",
                     "--dtype", "float32")
CHUNK = 32  # the chunked-prefill server's --chunked-prefill-size: a 169-token prompt takes 6 chunks


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    """The tiny random Llama: vocabulary 512, context 512 (specserve.test.tiny defaults)."""
    return model_factory("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, str(tmp_path_factory.mktemp("srt") / "server.log"), *SGLANG_TEST_FLAGS)
    yield s
    terminate_process(s.proc)


@pytest.fixture(scope="module")
def chunked_server(model_dir, tmp_path_factory):
    """The same server with a small --chunked-prefill-size, so long prompts are prefilled in several chunks."""
    s = start_server(model_dir, str(tmp_path_factory.mktemp("srt-chunked") / "server.log"), *SGLANG_TEST_FLAGS,
                     "--chunked-prefill-size", str(CHUNK))
    yield s
    terminate_process(s.proc)


@pytest.fixture(scope="module")
def vocab_size(server) -> int:
    return server.get("/model_info").json()["vocab_size"]


def generate(server, body: dict) -> dict | list:
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(r, param: str) -> None:
    """A 400 with OpenAI's error body, naming `param`."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert err["param"] == param or param in err["message"], err


def assert_is_top1_modulo_ties(entry: list, top: list) -> None:
    """run_logprob_check's greedy rule: the output entry is the top-1 entry, or, while consecutive top entries
    have exactly equal logprobs (a tie), one of the tied entries further down."""
    rank = 0
    while entry != top[rank]:
        assert rank + 1 < len(top) and top[rank][0] == top[rank + 1][0], (entry, top)
        rank += 1


# ---------------------------------------------------------------------------------------------- run_logprob_check
def run_logprob_check(server, input_len: int, output_len: int, temperature: float, logprob_start_len: int,
                      return_logprob: bool, top_logprobs_num: int) -> None:
    """SGLang's run_logprob_check: ids 0..input_len-1 as the prompt; checks counts and, when greedy, that the
    sampled entry is the top-1 entry."""
    res = generate(server, {
        "input_ids": list(range(input_len)),
        "sampling_params": {"temperature": temperature, "max_new_tokens": output_len, "ignore_eos": True},
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
    })
    meta = res["meta_info"]
    assert meta["prompt_tokens"] == input_len
    assert meta["completion_tokens"] == output_len
    if not return_logprob:
        return
    assert len(meta["input_token_logprobs"]) + logprob_start_len == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == output_len
    if not top_logprobs_num:
        return
    assert len(meta["input_top_logprobs"]) + logprob_start_len == meta["prompt_tokens"]
    assert len(meta["output_top_logprobs"]) == output_len
    for entry, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == top_logprobs_num
        if temperature == 0:
            assert_is_top1_modulo_ties(entry, top)


def test_logprob_mixed(server):
    """Ports TestSRTEndpoint.test_logprob_mixed (run_logprob_check over a grid, 8 requests at a time), lengths
    scaled from {1000..50000} to the 512-token context; temperature 0.5 added beside SGLang's 0."""
    grid = [
        (input_len, output_len, temperature, start, return_logprob, top_n)
        for input_len, output_len, temperature, start, return_logprob, top_n in itertools.product(
            (20, 100, 300), (4, 8), (0, 0.5), (0, 10, 50, 200), (True, False), (0, 5))
        if start < input_len
    ]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda args: run_logprob_check(server, *args), grid))


# ---------------------------------------------------------------------------------------------- logprob layout
def test_logprob_start_len(server):
    """Ports TestSRTEndpoint.test_logprob_start_len: a batch of two texts, logprob_start_len 4, texts in the
    entries. The input entries cover the prompt from token 4 (their texts are a suffix of the prompt) and the
    output entries' texts make up the output text."""
    start, new_tokens = 4, 4
    prompts = ["I have a very good idea on", "Today is a sunndy day and"]
    results = generate(server, {
        "text": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens},
        "return_logprob": True,
        "top_logprobs_num": 5,
        "return_text_in_logprobs": True,
        "logprob_start_len": start,
    })
    assert isinstance(results, list) and len(results) == len(prompts)
    for prompt, res in zip(prompts, results, strict=True):
        meta = res["meta_info"]
        assert meta["prompt_tokens"] == start + len(meta["input_token_logprobs"])
        suffix = "".join(x[-1] for x in meta["input_token_logprobs"])
        assert prompt.endswith(suffix) and 0 < len(suffix) < len(prompt)
        assert meta["completion_tokens"] == new_tokens
        assert len(meta["output_token_logprobs"]) == new_tokens
        assert res["text"] == "".join(x[-1] for x in meta["output_token_logprobs"])


def test_logprob_with_chunked_prefill(chunked_server):
    """Ports TestSRTEndpoint.test_logprob_with_chunked_prefill: a prompt prefilled in several chunks (here 169
    tokens with --chunked-prefill-size 32, for SGLang's ~72k tokens), logprob_start_len -1, greedy: each output
    entry is its position's top-1 entry, 5 top entries per position."""
    new_tokens = 4
    before = chunked_server.get("/server_info").json()
    assert before["chunked_prefill_size"] == CHUNK
    res = generate(chunked_server, {
        "text": "I have a very good idea on this. " * 8,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens},
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 5,
    })
    meta = res["meta_info"]
    assert meta["prompt_tokens"] > 4 * CHUNK
    steps = chunked_server.get("/server_info").json()["num_prefill_steps"] - before["num_prefill_steps"]
    assert steps >= -(-meta["prompt_tokens"] // CHUNK)  # the prompt really was prefilled in chunks
    assert meta["completion_tokens"] == new_tokens
    assert len(meta["output_token_logprobs"]) == new_tokens
    assert len(meta["output_top_logprobs"]) == new_tokens
    for entry, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert entry == top[0]
        assert len(top) == 5


@pytest.mark.parametrize("which", ["server", "chunked_server"])
def test_logprob_token_ids_chunked(request, which):
    """Ports TestSRTEndpoint.test_logprob_token_ids_chunked: probing token_ids_logprob at every prompt position;
    where the probed id is the actual next prompt token, the probe's logprob equals input_token_logprobs'
    (places=4). Run on both servers (whole and 32-token prefill chunks) since SGLang's run forces multi-chunk
    logprob stitching."""
    server = request.getfixturevalue(which)
    prompt_ids = list(range(5, 305))
    probe_ids = list(range(5, 305, 37))
    meta = generate(server, {
        "input_ids": prompt_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": probe_ids,
    })["meta_info"]
    token_lps, probe_rows = meta["input_token_logprobs"], meta["input_token_ids_logprobs"]
    assert len(probe_rows) == len(token_lps)
    checked = 0
    for (logprob, token_id, *_), probes in zip(token_lps, probe_rows, strict=True):
        if logprob is None or token_id not in probe_ids:
            continue
        by_id = {tid: lp for lp, tid, *_ in probes}
        assert by_id[token_id] == pytest.approx(logprob, abs=5e-5)
        checked += 1
    assert checked > 4


def _score(server, ids: list[int], sampling: dict, extra: dict) -> list:
    """A prefill-only request (max_new_tokens 0, logprob_start_len 0): the input entries of every id."""
    return generate(server, {
        "input_ids": ids,
        "sampling_params": {**sampling, "max_new_tokens": 0, "ignore_eos": True},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
        **extra,
    })["meta_info"]["input_token_logprobs"]


def _generate_then_rescore(server, extra: dict, sampling: dict, new_tokens: int) -> tuple[list, list, list[int]]:
    """test_logprob_match's two steps: sample with logprob_start_len 0, then prefill prompt + output with
    max_new_tokens 0 and logprob_start_len 0. Returns (the output logprobs, the re-scored ones of the same
    tokens, prompt + output ids)."""
    gen = generate(server, {
        "text": "I have a very good idea on how to",
        "sampling_params": {**sampling, "max_new_tokens": new_tokens, "ignore_eos": True},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
        **extra,
    })["meta_info"]
    n_prompt = gen["prompt_tokens"]
    assert len(gen["input_token_logprobs"]) == n_prompt and len(gen["output_token_logprobs"]) == new_tokens
    ids = [x[1] for x in gen["input_token_logprobs"]] + [x[1] for x in gen["output_token_logprobs"]]
    rescored = _score(server, ids, sampling, extra)[n_prompt:]
    assert [x[1] for x in rescored] == ids[n_prompt:]
    return [x[0] for x in gen["output_token_logprobs"]], [x[0] for x in rescored], ids


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_logprob_match(server):
    """Ports TestSRTEndpoint.test_logprob_match: the logprobs of sampled tokens (temperature 1.0) match those of
    a prefill-only re-score of prompt + output. SGLang allows 0.35 (bf16 GPU); float32 on CPU allows 1e-4
    (measured: about 1e-6)."""
    out, rescored, _ = _generate_then_rescore(server, {}, {"temperature": 1.0}, new_tokens=128)
    assert max_abs_diff(out, rescored) < 1e-4


def test_logprob_match_temp_scaled(server):
    """test_logprob_match with temp_scaled_logprobs (SGLang's internal flag, a request field here) at
    temperature 0.7: the sampled tokens' logprobs are those of logits / 0.7, and a re-score with the same flag and
    temperature gives them back; they differ from the raw (unscaled) re-score of the same tokens."""
    sampling, scaled = {"temperature": 0.7}, {"temp_scaled_logprobs": True}
    out, rescored, ids = _generate_then_rescore(server, scaled, sampling, new_tokens=64)
    assert max_abs_diff(out, rescored) < 1e-4
    raw = [x[0] for x in _score(server, ids, sampling, {})[len(ids) - len(out):]]
    assert max_abs_diff(out, raw) > 1e-2


def test_prefill_only_request(server):
    """No SGLang test of its own: SGLang's prefill-only requests (max_new_tokens 0, the scoring path
    test_logprob_match uses): no output, finish_reason length 0, input entries for every prompt token from
    logprob_start_len (the first one None), none by default."""
    ids = list(range(40, 80))
    res = generate(server, {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "token_ids_logprob": [41, 42],
    })
    meta = res["meta_info"]
    assert res["text"] == "" and res["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(ids)
    assert [x[1] for x in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(x[0], float) and x[0] <= 0 for x in meta["input_token_logprobs"][1:])
    assert len(meta["input_top_logprobs"]) == len(ids) and meta["input_top_logprobs"][0] is None
    assert all(len(row) == 3 for row in meta["input_top_logprobs"][1:])
    assert len(meta["input_token_ids_logprobs"]) == len(ids)
    assert [[x[1] for x in row] for row in meta["input_token_ids_logprobs"][1:]] == [[41, 42]] * (len(ids) - 1)
    assert meta["output_token_logprobs"] == []

    mid = generate(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                            "logprob_start_len": 25})["meta_info"]
    assert [x[1] for x in mid["input_token_logprobs"]] == ids[25:]
    assert mid["input_token_logprobs"][0][0] is None
    # the same scores as the full request's, for the same positions
    full = {i: x[0] for i, x in enumerate(meta["input_token_logprobs"])}
    for i, x in enumerate(mid["input_token_logprobs"][1:], start=26):
        assert x[0] == pytest.approx(full[i], abs=1e-4)

    default = generate(server, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                "return_logprob": True})["meta_info"]
    assert default["input_token_logprobs"] == [] and default["completion_tokens"] == 0


# ---------------------------------------------------------------------------------------------- cache and info
def test_cache_tokens(server):
    """Ports TestSRTEndpoint.test_cache_tokens with lengths / 50 (100 -> 2 is too short, so 100 -> 20, 1000 ->
    100, 10000 -> 200, 11000 -> 220): after two flushes, cached_tokens counts the reused prefix, and a full
    repeat reuses all but the last prompt token (which is always recomputed)."""
    server_info = server.get("/server_info").json()
    assert server_info["num_running_reqs"] == 0 and server_info["num_waiting_reqs"] == 0
    for _ in range(2):
        assert server.post("/flush_cache").status_code == 200
    page_size = server.get("/server_info").json().get("page_size") or 1

    def align_down(n: int) -> int:
        return n // page_size * page_size

    def cached(ids) -> int:
        return generate(server, {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 1}}
                        )["meta_info"]["cached_tokens"]

    assert cached(range(0, 20)) == 0
    assert cached(range(0, 200)) == align_down(20)
    assert cached(range(0, 200)) == align_down(199)
    assert cached(range(0, 100)) == align_down(99)
    assert cached(range(0, 220)) == align_down(200)


def test_get_server_info(server):
    """Ports TestSRTEndpoint.test_get_server_info: GET /server_info has an int max_total_num_tokens and a str
    version; the scheduler state is also under internal_states[0] (where SGLang clients read it)."""
    r = server.get("/server_info")
    assert r.status_code == 200
    info = r.json()
    assert isinstance(info["max_total_num_tokens"], int) and info["max_total_num_tokens"] > 0
    assert isinstance(info["version"], str) and info["version"]
    assert isinstance(info["internal_states"], list) and isinstance(info["internal_states"][0], dict)
    assert info["internal_states"][0]["max_total_num_tokens"] == info["max_total_num_tokens"]


def test_get_server_info_concurrent(server):
    """Ports TestSRTEndpoint.test_get_server_info_concurrent: concurrent GET /server_info (16 here, 4 in SGLang)
    all answer, and the server still generates afterwards."""
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: server.get("/server_info"), range(16)))
    assert all(r.status_code == 200 and isinstance(r.json()["max_total_num_tokens"], int) for r in responses)
    assert server.get("/health_generate").status_code == 200


# ---------------------------------------------------------------------------------------------- logit_bias
PROMPT = "The capital of France is"
TARGET_ID = 300  # an ordinary byte-pair token of the 512-token vocabulary (SGLang: 60704, "Paris")


def _sampled(res: dict) -> list[int]:
    return [x[1] for x in res["meta_info"]["output_token_logprobs"]]


def test_logit_bias(server):
    """Ports TestSRTEndpoint.test_logit_bias: a +100 bias on one id makes every sampled token (temperature 1.0)
    that id."""
    res = generate(server, {"text": PROMPT, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 4, "logit_bias": {str(TARGET_ID): 100.0}}, "return_logprob": True})
    assert _sampled(res) == [TARGET_ID] * 4
    assert res["output_ids"] == [TARGET_ID] * 4


def test_forbidden_token(server):
    """Ports TestSRTEndpoint.test_forbidden_token: a -100 bias keeps a token out of 50 sampled ones. The forbidden
    token is the model's own greedy first token for the prompt (SGLang: "rice" after a prompt asking for it), so
    without the bias it is the likeliest choice."""
    prompt = "Only output 'rice' exactly like this, in lowercase ONLY: rice"
    favourite = generate(server, {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
                         )["output_ids"][0]
    res = generate(server, {"text": prompt, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 50, "ignore_eos": True, "logit_bias": {str(favourite): -100.0}},
        "return_logprob": True})
    assert len(_sampled(res)) == 50
    assert favourite not in _sampled(res)


def test_logit_bias_isolation(server):
    """Ports TestSRTEndpoint.test_logit_bias_isolation: a request with a +100 bias samples only its target; the
    next one, without a bias, samples something else. Also run as one batch (the two requests side by side)."""
    biased = {"temperature": 1.0, "max_new_tokens": 4, "logit_bias": {str(TARGET_ID): 100.0}}
    plain = {"temperature": 1.0, "max_new_tokens": 4}
    first = generate(server, {"text": PROMPT, "sampling_params": biased, "return_logprob": True})
    second = generate(server, {"text": PROMPT, "sampling_params": plain, "return_logprob": True})
    assert all(x == TARGET_ID for x in _sampled(first))
    assert any(x != TARGET_ID for x in _sampled(second))

    both = generate(server, {"text": [PROMPT, PROMPT], "sampling_params": [biased, plain], "return_logprob": True})
    assert all(x == TARGET_ID for x in _sampled(both[0]))
    assert any(x != TARGET_ID for x in _sampled(both[1]))


# ---------------------------------------------------------------------------------------------- refusals
def test_token_ids_logprob_out_of_vocabulary(server, vocab_size):
    """No SGLang test; SGLang's GenerateReqInput check ("token_ids_logprob contains out-of-vocabulary token
    id"): a 400 with the OpenAI error body naming the field; an id just inside the vocabulary is fine."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    assert_error(server.post("/generate", json={**body, "token_ids_logprob": [3, vocab_size]}), "token_ids_logprob")
    ok = generate(server, {**body, "token_ids_logprob": [vocab_size - 1]})
    assert [x[1] for x in ok["meta_info"]["output_token_ids_logprobs"][0]] == [vocab_size - 1]


def test_logprob_start_len_beyond_prompt(server):
    """No SGLang test; SGLang's scheduler (handle_generate_request) refuses logprob_start_len above the prompt
    length ("... is higher than the number of input tokens ... Please use a smaller logprob_start_len.") with a
    400."""
    r = server.post("/generate", json={"input_ids": list(range(10, 20)), "sampling_params": {"max_new_tokens": 2},
                                       "return_logprob": True, "logprob_start_len": 15})
    assert_error(r, "logprob_start_len")


def test_custom_logit_processor_is_refused(server):
    """Stands in for TestSRTEndpoint.test_custom_logit_processor (+ _batch_mixed): SGLang runs a serialized
    CustomLogitProcessor class (dill) under --enable-custom-logit-processor. That is inapplicable to specserve,
    which has neither the flag nor the deserializer: a non-null custom_logit_processor is a 400 naming the
    field, never silently ignored; null (what SGLang clients send by default) is accepted."""
    processor = json.dumps({"callable": "80049500"})  # the shape of CustomLogitProcessor.to_str()
    r = server.post("/generate", json={
        "text": "Question: Is Paris the Capital of France? Answer:",
        "sampling_params": {"temperature": 0.0, "custom_params": {"token_id": 5}},
        "return_logprob": True,
        "custom_logit_processor": processor,
    })
    assert_error(r, "custom_logit_processor")
    ok = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "custom_logit_processor": None})
    assert ok["meta_info"]["completion_tokens"] == 2


def test_sglang_default_fields_are_accepted(server):
    """No SGLang test; SGLang's clients (sglang.Engine, its OpenAI layer) send GenerateReqInput fields at their
    defaults: they are accepted and change nothing (same greedy output as without them); a LoRA adapter
    (non-default lora_path) is a 400 naming lora_path."""
    base = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    defaults = {"lora_path": None, "return_routed_experts": False, "logprob_start_len": -1,
                "return_hidden_states": False}
    plain, with_defaults = generate(server, base), generate(server, {**base, **defaults})
    assert with_defaults["output_ids"] == plain["output_ids"] and with_defaults["text"] == plain["text"]
    assert with_defaults["meta_info"]["completion_tokens"] == 6
    assert_error(server.post("/generate", json={**base, "lora_path": "my-adapter"}), "lora_path")


def test_logprob_entries_are_log_probabilities(server):
    """Ports TestSRTEndpoint.test_logprob (SGLang only prints the answer: return_logprob, top_logprobs_num 5,
    texts, logprob_start_len 0), asserting the logprob wire format every SGLang logprob test reads:
    [logprob, token_id, text] entries, top entries in descending order, each output entry's token the output id,
    logprobs <= 0 and exp-summing to <= 1 per row."""
    res = generate(server, {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 5},
                            "return_logprob": True, "top_logprobs_num": 5, "return_text_in_logprobs": True,
                            "logprob_start_len": 0})
    meta = res["meta_info"]
    assert [x[1] for x in meta["output_token_logprobs"]] == res["output_ids"]
    for row in meta["output_top_logprobs"] + meta["input_top_logprobs"][1:]:
        values = [x[0] for x in row]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        assert all(isinstance(x[2], str) for x in row)


# ---------------------------------------------------------------------------------------------- tokenize
def test_tokenize_various_inputs(server, model_dir):
    """Ports TestTokenizeDetokenize.test_tokenize_various_inputs: a prompt or a list of prompts, with and without
    special tokens; counts add up; an empty prompt has 0 tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for prompt, special in [("def f(x): return x", True), ("def f(x): return x", False), ("", False)]:
        body = server.post("/tokenize", json={"model": "any", "prompt": prompt, "add_special_tokens": special}).json()
        assert body["tokens"] == tok.encode(prompt, add_special_tokens=special)
        assert body["count"] == len(body["tokens"])
    many = server.post("/tokenize", json={"prompt": ["a b", "c d e"]}).json()
    assert many["tokens"] == [tok.encode("a b"), tok.encode("c d e")]
    assert many["count"] == [len(x) for x in many["tokens"]] and isinstance(many["max_model_len"], int)


def test_tokenize_invalid_type(server):
    """Ports test_tokenize_invalid_type: a number as the prompt is a 400."""
    assert_error(server.post("/tokenize", json={"prompt": 12345}), "prompt")


def test_openai_tokenize_chat_messages(server, model_dir):
    """Ports test_openai_tokenize_chat_messages: /v1/tokenize renders messages through the chat template, as
    the chat endpoint does, tools included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    body = server.post("/v1/tokenize", json={"model": "any", "messages": messages}).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tok.encode(text, add_special_tokens=False) and body["count"] == len(body["tokens"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    body = server.post("/v1/tokenize", json={"messages": messages, "tools": tools}).json()
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tok.encode(text, add_special_tokens=False) and '"add"' in text


def test_detokenize_roundtrip(server):
    """Ports test_detokenize_roundtrip: tokens from /tokenize (with or without special tokens) come back as the
    text with skip_special_tokens; an empty list is ""."""
    text = "def add(a, b):\n    return a + b"
    for special in (True, False):
        ids = server.post("/tokenize", json={"prompt": text, "add_special_tokens": special}).json()["tokens"]
        back = server.post("/detokenize", json={"tokens": ids, "skip_special_tokens": True}).json()
        assert back["text"] == text
    assert server.post("/detokenize", json={"tokens": []}).json()["text"] == ""


def test_detokenize_invalid_tokens(server, vocab_size):
    """Ports test_detokenize_invalid_tokens: strings are a 400; an id outside the vocabulary is also a 400 here
    (SGLang answers 500; specserve never answers 500 to a bad request)."""
    assert_error(server.post("/detokenize", json={"tokens": ["a", "b"]}), "tokens[0]")
    assert_error(server.post("/detokenize", json={"tokens": [1, -1, 2]}), "tokens")
    assert_error(server.post("/detokenize", json={"tokens": [vocab_size]}), "tokens")
