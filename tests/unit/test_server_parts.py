"""Pure pieces of the HTTP server, on small hand-checked inputs (no server process)."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from specserve.config import ConfigError
from specserve.frontend import RequestError, RequestFactory, prepare_requests
from specserve.request import ReqOutput
from specserve.server import openai_format as fmt
from specserve.server.errors import from_request_error, loc_to_param
from specserve.server.manager import Job, read_chat_template
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.worker import ReqSpec


@pytest.fixture(scope="module")
def factory(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return RequestFactory(tok, len(tok), 256, {1}, 0, torch.device("cpu"))


def test_finish_reason_mapping():
    assert fmt.finish_reason(None) == (None, None)
    assert fmt.finish_reason({"type": "stop", "matched": 7}) == ("stop", 7)
    assert fmt.finish_reason({"type": "stop", "matched": "\n\n"}) == ("stop", "\n\n")
    assert fmt.finish_reason({"type": "length", "length": 3}) == ("length", None)
    assert fmt.finish_reason({"type": "abort", "message": "x"}) == ("abort", None)


def test_usage_counts_each_prompt_once_and_every_sample():
    metas = [  # 2 prompts x n=2
        {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 2},
        {"prompt_tokens": 5, "completion_tokens": 4, "cached_tokens": 0},
        {"prompt_tokens": 7, "completion_tokens": 1, "cached_tokens": 1},
        {"prompt_tokens": 7, "completion_tokens": 2, "cached_tokens": 0},
    ]
    u = fmt.results_usage(metas, n=2)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (12, 10, 22)
    assert u.prompt_tokens_details.cached_tokens == 3


def test_chat_request_to_sampling_params():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 3,
        "temperature": 0.5, "top_k": 4, "stop": "x", "logprobs": True, "top_logprobs": 2, "seed": 11,
        "min_tokens": 1, "ignore_eos": True, "n": 2, "logit_bias": {"5": 1.5}})
    assert fmt.chat_sampling_params(req) == {
        "temperature": 0.5, "top_k": 4, "stop": "x", "seed": 11, "logit_bias": {"5": 1.5}, "ignore_eos": True,
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False, "n": 2,
        "max_new_tokens": 3, "min_new_tokens": 1, "return_logprob": True, "top_logprobs_num": 2}


def test_completion_defaults_and_strict_types():
    req = CompletionRequest.model_validate({"prompt": [1, 2]})
    sp = fmt.completion_sampling_params(req)
    assert sp["max_new_tokens"] == 16 and "return_logprob" not in sp and "temperature" not in sp
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "3"})  # no coercion from strings
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "echo": 1})


def test_loc_to_param():
    assert loc_to_param(("messages", 0, "role")) == "messages[0].role"
    assert loc_to_param(("prompt", "list[int]", 3)) == "prompt[3]"
    assert loc_to_param(("stop", "str")) == "stop"
    assert loc_to_param(()) is None


def test_request_error_uses_openai_names():
    e = from_request_error(RequestError("max_new_tokens: too many", "max_new_tokens"), openai_names=True)
    assert (e.status, e.param, e.message) == (400, "max_tokens", "max_tokens: too many")
    assert from_request_error(RequestError("max_new_tokens: x", "max_new_tokens")).param == "max_new_tokens"


class _FakeTokenizer:
    pieces = {10: "ab", 11: "c", 12: "déf"}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)

    def convert_ids_to_tokens(self, i):
        return self.pieces[i]


def test_completion_logprobs_offsets_and_tops():
    meta = {"output_token_logprobs": [(-0.1, 10, None), (-0.2, 11, None), (-0.3, 12, None)],
            "output_top_logprobs": [[(-0.1, 10, None)], [(-0.2, 11, None)], [(-0.3, 12, None)]]}
    lp = fmt.completion_logprobs(_FakeTokenizer(), *fmt.output_logprobs(meta), text_offset=4)
    assert lp.tokens == ["ab", "c", "déf"] and lp.token_logprobs == [-0.1, -0.2, -0.3]
    assert lp.text_offset == [4, 6, 7]
    assert lp.top_logprobs == [{"ab": -0.1}, {"c": -0.2}, {"déf": -0.3}]
    chat = fmt.chat_logprobs(_FakeTokenizer(), *fmt.output_logprobs(meta))
    assert [c.token for c in chat.content] == ["ab", "c", "déf"]
    assert chat.content[2].bytes == list("déf".encode())
    # echo: the prompt's entries first, its first logprob and top row None, offsets from 0
    meta |= {"input_token_logprobs": [(None, 11, None), (-0.5, 10, None)],
             "input_top_logprobs": [None, [(-0.4, 12, None)]]}
    prompt = fmt.completion_logprobs(_FakeTokenizer(), *fmt.prompt_logprobs(meta), text_offset=0)
    both = fmt.join_logprobs(prompt, fmt.completion_logprobs(_FakeTokenizer(), *fmt.output_logprobs(meta), 3))
    assert both.tokens == ["c", "ab", "ab", "c", "déf"] and both.token_logprobs == [None, -0.5, -0.1, -0.2, -0.3]
    assert both.text_offset == [0, 1, 3, 5, 6]
    assert both.top_logprobs == [None, {"déf": -0.4}, {"ab": -0.1}, {"c": -0.2}, {"déf": -0.3}]


def test_token_bytes_of_partial_characters():
    """A byte-level token holding part of a UTF-8 character decodes to U+FFFD, yet its logprob bytes are its own
    byte; a whole token's bytes are its text's."""
    from transformers import AutoTokenizer

    from specserve.demo_models import demo_path

    tok = AutoTokenizer.from_pretrained(demo_path("demo"))
    partial = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert len(partial) > 100  # the byte alphabet's bytes >= 0x80, and merges of them
    for i in partial:
        raw = bytes(fmt.token_bytes(tok, i))
        assert raw and all(b >= 0x80 for b in raw)
        with pytest.raises(UnicodeDecodeError):
            raw.decode()
    assert len({bytes(fmt.token_bytes(tok, i)) for i in partial}) == len(partial)  # each its own bytes
    assert fmt.token_bytes(tok, tok.convert_tokens_to_ids("\u00e2")) == [0xE2]  # GPT-2's stand-in for byte 0xE2
    for i in range(300):
        text = tok.decode([i])
        if "\ufffd" not in text:
            assert bytes(fmt.token_bytes(tok, i)).decode() == text


def test_read_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(ConfigError, match="^--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def _out(rid, ids, finished=None) -> ReqOutput:
    return ReqOutput(rid, ids, finished, prompt_tokens=4, completion_tokens=0, cached_tokens=0)


def test_metrics_ttft_and_inter_token_latency():
    m = ServerMetrics()
    m.on_output(_out("r", [5, 6]), start=10.0, now=11.0)  # TTFT 1.0; token 2 arrived with it: ITL 0
    m.on_output(_out("r", [7, 8]), start=10.0, now=13.0)  # 2 tokens over 2.0 s: ITL 1.0 each
    m.on_output(_out("r", [], {"type": "length"}), start=10.0, now=13.5)
    reg = m.registry
    assert reg.get_sample_value("specserve:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert reg.get_sample_value("specserve:inter_token_latency_seconds_count") == 3
    assert reg.get_sample_value("specserve:inter_token_latency_seconds_sum") == pytest.approx(2.0)
    assert reg.get_sample_value("specserve:e2e_request_latency_seconds_sum") == pytest.approx(3.5)
    assert reg.get_sample_value("specserve:num_requests_total", {"finish_reason": "length"}) == 1
    text = m.render({"num_running_reqs": 3, "kv_usage": 0.25, "worker_pid": 99, "draining": False}).decode()
    assert "specserve:num_running_reqs 3.0" in text and "specserve:token_usage 0.25" in text
    assert "worker_pid" not in text and "draining" not in text
    assert "spec_verify_steps" not in text  # no speculative counters without speculative decoding


def test_metrics_export_speculative_counters():
    m = ServerMetrics()
    state = {"spec_verify_ct": 5, "spec_accepted_per_position": [3, 2, 0], "avg_spec_accept_length": 2.0}
    m.render(state)
    reg = m.registry
    assert reg.get_sample_value("specserve:spec_verify_steps_total") == 5
    per_pos = [reg.get_sample_value("specserve:spec_accepted_tokens_per_position_total", {"position": str(k)})
               for k in (1, 2, 3, 4)]
    assert per_pos == [3, 2, 0, None]
    types = {f.name: f.type for f in reg.collect()}
    assert types["specserve:spec_verify_steps"] == types["specserve:spec_accepted_tokens_per_position"] == "counter"
    assert "specserve:avg_spec_accept_length 2.0" in m.render(state).decode()  # gauges stay


def test_job_merges_piled_up_outputs(factory):
    prepared, single = prepare_requests(factory, "hello world", {"max_new_tokens": 4, "n": 2, "seed": 1}, None,
                                        rid="job")
    assert not single and [p.req.rid for p in prepared] == ["job-0", "job-1"]
    ids = factory.tokenize(" abc def")[:2]

    async def inline(fn, *args):  # the manager runs these on its tokenizer pool
        return fn(*args)

    async def run() -> list:
        job = Job("job", "job", prepared, stream=True, run=inline)
        job.push(0, _out("job-0", [ids[0]]))
        job.push(0, _out("job-0", [ids[1]], {"type": "length"}))
        job.push(1, _out("job-1", [ids[0]], {"type": "length"}))
        return [batch async for batch in job.chunks()], job

    batches, job = asyncio.run(run())
    assert len(batches) == 1  # everything that was waiting comes out as one batch, one chunk per sample
    (i0, c0), (i1, c1) = batches[0]
    assert (i0, c0["output_ids"], i1, c1["output_ids"]) == (0, ids, 1, ids[:1])
    assert c0["text"] == factory.tokenizer.decode(ids) and job.done.is_set()


def test_batch_rids_get_suffixes(factory):
    prepared, single = prepare_requests(factory, ["a", "b"], None, None, rid="x")
    assert [p.req.rid for p in prepared] == ["x-0", "x-1"] and not single
    with pytest.raises(RequestError, match="rid"):
        prepare_requests(factory, ["a", "b"], None, None, rid=["only-one"])


def test_req_spec_round_trip_keeps_the_random_stream(factory):
    (p,) = prepare_requests(factory, "hi", {"temperature": 0.7, "seed": 42, "stop": ["\n"]}, None)[0]
    spec = pickle.loads(pickle.dumps(ReqSpec.from_req(p.req)))
    req = spec.to_req(factory.tokenizer, torch.device("cpu"))
    assert (req.rid, req.origin_input_ids, req.stop_ids) == (p.req.rid, p.req.origin_input_ids, p.req.stop_ids)
    assert req.params == p.req.params and req.stop_checker is not None
    assert torch.equal(torch.rand(5, generator=req.generator), torch.rand(5, generator=p.req.generator))
    (g,) = prepare_requests(factory, "hi", {"temperature": 0}, None)[0]
    assert ReqSpec.from_req(g.req).seed is None
