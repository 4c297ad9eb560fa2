"""The server with speculative decoding on (NGRAM: no draft model needed): lossless through HTTP, speculative
metrics in meta_info, /get_server_info and /metrics, and multi-token steps reaching streaming clients."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.speculative.accept_stats import sum_counts
from specserve.utils import terminate_process
from tests.server.conftest import start_server
from tests.server.helpers import GREEDY, metric, sse_json

REPETITIVE = [
    "def f(x):\n    return x\ndef f(x):\n    return x\ndef f(",
    "a b c d e f a b c d e f a b c",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "x = 1\ny = 2\nx = 1\ny = 2\nx =",
]
NEW = 48


@pytest.fixture(scope="module")
def target(model_factory) -> str:
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    with Engine(model_path=target, max_total_tokens=8192, num_threads=1) as e:
        return [o["output_ids"] for o in e.generate(REPETITIVE, {**GREEDY, "max_new_tokens": NEW})]


@pytest.fixture(scope="module")
def spec_server(target, tmp_path_factory):
    s = start_server(target, str(tmp_path_factory.mktemp("spec") / "server.log"), "--max-total-tokens", "8192",
                     "--enable-metrics", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
                     "--disable-speculative-auto-off")  # every step speculative: these tests count verify steps
    yield s
    terminate_process(s.proc)


def test_generate_is_lossless_and_reports_spec_meta(spec_server, plain):
    outs = spec_server.post("/generate", json={"text": REPETITIVE,
                                               "sampling_params": {**GREEDY, "max_new_tokens": NEW}}).json()
    assert [o["output_ids"] for o in outs] == plain
    metas = [o["meta_info"] for o in outs]
    assert all(m["spec_verify_ct"] > 0 for m in metas)
    assert max(m["spec_accept_length"] for m in metas) > 1.0  # drafting really happened
    assert all(m["spec_accept_length"] == pytest.approx(NEW / m["spec_verify_ct"]) for m in metas)

    info = spec_server.info()
    assert info["speculative_algorithm"] == "NGRAM" and info["avg_spec_accept_length"] > 1.0
    assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]
    text = spec_server.get("/metrics").text
    assert metric(text, "specserve:avg_spec_accept_length") == pytest.approx(info["avg_spec_accept_length"])


def _spec_counters(server) -> tuple[float, list[float]]:
    """(verify steps, accepted counts at positions 1..8) from /metrics."""
    text = server.get("/metrics").text
    per_pos = [metric(text, "specserve:spec_accepted_tokens_per_position_total", f'position="{k}"')
               for k in range(1, 9)]
    return metric(text, "specserve:spec_verify_steps_total"), per_pos


def test_metrics_count_verify_steps_and_accepted_positions(spec_server):
    """The Prometheus counters grow by exactly what the requests' meta_info reports, and /get_server_info's
    per-position rates are the counts over the verify steps."""
    steps0, pos0 = _spec_counters(spec_server)
    outs = spec_server.post("/generate", json={"text": REPETITIVE,
                                               "sampling_params": {**GREEDY, "max_new_tokens": 24}}).json()
    steps1, pos1 = _spec_counters(spec_server)
    metas = [o["meta_info"] for o in outs]
    assert steps1 - steps0 == sum(m["spec_verify_ct"] for m in metas) > 0
    want = sum_counts([m["spec_accept_per_position"] for m in metas])
    assert 0 < len(want) <= 7  # NGRAM with 8 draft tokens drafts at most 7 deep
    assert [b - a for a, b in zip(pos0, pos1, strict=True)] == want + [0] * (8 - len(want))
    assert want[0] > 0  # drafts were accepted, so the counters really moved
    info = spec_server.info()
    assert info["spec_accepted_per_position"] == pos1[: len(info["spec_accepted_per_position"])]
    assert info["spec_accept_rate_per_position"] == pytest.approx(
        [c / steps1 for c in info["spec_accepted_per_position"]])


def test_streaming_carries_multi_token_steps(spec_server, plain):
    body = {"prompt": REPETITIVE[0], "max_tokens": NEW, "stream": True, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with spec_server.post("/v1/completions", json=body, stream=True) as resp:
        events = sse_json(resp)
    counts = [e["usage"]["completion_tokens"] for e in events]
    steps = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert counts[-1] == NEW and max(steps) > 1  # accepted drafts arrive as several tokens in one chunk
    full = spec_server.post("/v1/completions", json={"prompt": REPETITIVE[0], "max_tokens": NEW, **GREEDY}).json()
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full["choices"][0]["text"]


def _seed_command_draft(algorithm: str, model_factory, tmp_path) -> tuple[str, list[str]]:
    """The tiny target and the extra flags of the seed's command for `algorithm` (drafts built to be accepted)."""
    from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir, make_mimo_dir

    tree = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    if algorithm == "EAGLE":
        target = model_factory("llama", num_hidden_layers=1, unit_embeddings=True)
        draft = make_eagle_head_dir(str(tmp_path / "eagle"), target, kind="self")
    elif algorithm == "EAGLE3":
        target = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
        draft = make_eagle3_head_dir(str(tmp_path / "eagle3"), target, kind="self")
    elif algorithm == "STANDALONE":
        target = draft = model_factory("llama")
    else:  # MTP: the seed's MiMo example, EAGLE with no draft path and (1, 1, 2)
        target = make_mimo_dir(str(tmp_path / "mimo"), kind="self")
        return target, ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
                        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
    return target, ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft, *tree]


def _chat_answer(target: str, log_path: str, flags: list[str], messages: list[dict], max_tokens: int) -> tuple:
    """Launch a server with `flags`, ask one greedy chat completion through the official openai client (EOS
    ignored, so exactly max_tokens are generated), stop it: (answer text, /get_server_info)."""
    import openai

    s = start_server(target, log_path, *flags)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        r = client.chat.completions.create(model=target, messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens
        return r.choices[0].message.content, s.info()
    finally:
        terminate_process(s.proc)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "MTP"])
def test_seed_commands_answer_chat_completions(algorithm, model_factory, tmp_path):
    """The seed's launch commands (module name changed, tiny models) serve chat completions through the official
    openai client with the same greedy answer as plain decoding, and report accept metrics."""
    target, flags = _seed_command_draft(algorithm, model_factory, tmp_path)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    answers = []
    for extra in ([], flags):
        answer, info = _chat_answer(target, str(tmp_path / f"server{len(answers)}.log"),
                                    ["--max-total-tokens", "4096", *extra], messages, 32)
        answers.append(answer)
    assert answers[0] == answers[1]
    assert info["avg_spec_accept_length"] > 1.0 and info["spec_verify_ct"] > 0


# The seed's NGRAM example, every flag as written (`--model Qwen/Qwen2.5-7B-Instruct` becomes the tiny target).
# On CPU, --cuda-graph-max-bs is accepted and ignored (no CUDA graphs here) and --mem-fraction-static 0.8 sizes
# the KV cache as a share of --cpu-memory-budget-gb; both are possible values, so nothing is changed.
SEED_NGRAM_SPEC_FLAGS = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16",
                         "--speculative-ngram-max-match-window-size", "12", "--speculative-ngram-max-bfs-breadth", "10"]
SEED_NGRAM_OTHER_FLAGS = ["--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.8", "--log-level", "warning"]


def test_seed_ngram_command_answers_chat_completions(target, tmp_path):
    """The seed's NGRAM launch command answers the seed's chat request (greedy, 64 tokens) through the official
    openai client with the answer of the same launch without speculation, and its accept metrics show drafted
    tokens were accepted."""
    messages = [{"role": "user", "content": "List 3 countries and their capitals."}]
    plain, _ = _chat_answer(target, str(tmp_path / "plain.log"), SEED_NGRAM_OTHER_FLAGS, messages, 64)
    # + --disable-speculative-auto-off: on this tiny model plain steps measure about as fast as NGRAM's, and the
    # drafting guard below needs every step to speculate
    answer, info = _chat_answer(target, str(tmp_path / "ngram.log"),
                                SEED_NGRAM_SPEC_FLAGS + SEED_NGRAM_OTHER_FLAGS + ["--disable-speculative-auto-off"],
                                messages, 64)
    assert answer == plain
    flags = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ngram_max_match_window_size",
             "speculative_ngram_max_bfs_breadth", "cuda_graph_max_bs", "mem_fraction_static", "log_level")
    assert [info[f] for f in flags] == ["NGRAM", 16, 12, 10, 8, 0.8, "warning"]
    assert info["spec_verify_ct"] > 0 and info["avg_spec_accept_length"] > 1.0
