"""Tensor parallelism on CPU (2 ranks, float32; shared memory on one node, gloo across "nodes"): a TP=2 engine gives
what one process gives, token for token, for every architecture family and every speculative algorithm, under
chunked prefill and radix reuse, and for seeded sampling; two "nodes" on localhost likewise; a rank that dies ends
the engine with a message, not a hang."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specserve import Engine
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir, make_mimo_dir
from specserve.utils import free_port
from tests.engine.grammars import constrained
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.model.test_gemma import make_gemma_dir
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

ENGINE = dict(dtype="float32", max_total_tokens=4096)
PARAMS = [greedy(20), greedy(12), greedy(16), greedy(20)]

# architecture -> config overrides: GQA with as many KV heads as ranks; one KV head (replicated on both ranks) and a
# vocabulary that does not split evenly (padded); q/k/v biases; per-head q/k norms; tied embeddings with scaling
FAMILIES = {
    "llama": ("llama", {}),
    "llama-mqa-odd-vocab": ("llama", dict(num_key_value_heads=1, vocab_size=509, tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),  # tied embeddings, scaled; head_dim apart from hidden / heads
}


def outputs(path: str, prompts=PROMPTS[:4], params=PARAMS, **kw) -> list[list[int]]:
    with Engine(model_path=path, **{**ENGINE, **kw}) as e:
        outs = e.generate(list(prompts), params)
        assert_no_kv_leak(e)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_one_process_with_chunked_prefill_and_radix_reuse(model_factory, tmp_path, tokenizer_dir, family):
    arch, overrides = FAMILIES[family]
    path = make_gemma_dir(str(tmp_path), tokenizer_dir) if arch == "gemma" else model_factory(arch, **overrides)
    want = outputs(path)
    with Engine(model_path=path, tp_size=2, chunked_prefill_size=5, **ENGINE) as e:
        first = e.generate(PROMPTS[:4], PARAMS)
        again = e.generate(PROMPTS[:4], PARAMS)  # from the prefix cache
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again] == want
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    assert info["tp_size"] == 2


@pytest.fixture(scope="module")
def spec_setups(model_factory, tmp_path_factory, tokenizer_dir):
    """algorithm -> (target, engine kwargs): drafts that mirror their targets (many drafts land)."""
    d = tmp_path_factory.mktemp("tp-drafts")
    target = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)
    bigram = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
    mimo = make_mimo_dir(str(d / "mimo"), kind="self", tokenizer_dir=tokenizer_dir, max_position_embeddings=1024)
    return {
        "EAGLE": (target, spec_kwargs("EAGLE", make_eagle_head_dir(str(d / "e"), target), 3, 2, 5)),
        "EAGLE3": (bigram, spec_kwargs("EAGLE3", make_eagle3_head_dir(str(d / "e3"), bigram), 3, 2, 5)),
        "STANDALONE": (target, spec_kwargs("STANDALONE", target, 3, 2, 5)),
        "NGRAM": (target, spec_kwargs("NGRAM", None, 3, 2, 5)),
        "MTP": (mimo, spec_kwargs("EAGLE", None, 3, 1, 4)),
    }


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM", "MTP"])
def test_tp2_speculative_equals_one_process_plain(spec_setups, algorithm):
    path, kw = spec_setups[algorithm]
    prompts = [p * 3 for p in PROMPTS[:4]]  # repetitive text: n-gram drafts land too
    want = outputs(path, prompts)
    with Engine(model_path=path, tp_size=2, disable_speculative_auto_off=True, chunked_prefill_size=5, **kw,
                **ENGINE) as e:
        outs = e.generate(prompts, PARAMS)
        again = e.generate(prompts, PARAMS)  # from the prefix cache
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again] == want
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    assert_drafting_happened(outs + again)


def test_tp2_seeded_sampling_and_prompt_logprobs_equal_one_process(model_factory):
    """Each seed draws the same tokens from the same distributions, so the sampled distribution is one process's;
    prompt logprobs come from rank 0's LM head calls outside a forward (the followers join them)."""
    path = model_factory("llama")
    params = [{"temperature": 0.9, "top_p": 0.95, "seed": seed, "max_new_tokens": 12, "ignore_eos": True}
              for seed in range(12)]
    prompts = [PROMPTS[s % 4] for s in range(12)]
    want = outputs(path, prompts, params)
    assert len({tuple(w) for w in want}) > 6  # the seeds matter: sampling, not a fixed answer
    assert outputs(path, prompts, params, tp_size=2) == want
    scored = {"temperature": 0, "max_new_tokens": 2, "return_logprob": True, "logprob_start_len": 0}
    got = []
    for tp in (1, 2):
        with Engine(model_path=path, tp_size=tp, **ENGINE) as e:
            got.append(e.generate(PROMPTS[0], scored)["meta_info"]["input_token_logprobs"])
    assert len(got[0]) > 3
    assert [t for _, t, *_ in got[0]] == [t for _, t, *_ in got[1]]
    assert all(a[0] == b[0] or abs(a[0] - b[0]) < 1e-4 for a, b in zip(got[0][1:], got[1][1:], strict=True))


def test_tp2_structured_outputs_with_jump_forward_equal_one_process(model_factory):
    """Decode forwards that carry grammar-forced tokens (several rows for a request, logits for its last) run on both
    ranks alike: the outputs of one process decoding every token."""
    path = model_factory("llama")
    params = [constrained("json_schema", 40), constrained("structural_tag", 60), constrained("regex"), greedy(12)]
    want = outputs(path, PROMPTS[:4], params, disable_grammar_jump_forward=True)
    with Engine(model_path=path, tp_size=2, **ENGINE) as e:
        got = [o["output_ids"] for o in e.generate(PROMPTS[:4], params)]
        jumped = e.get_server_info()["grammar_jump_forward_tokens"]
        assert_no_kv_leak(e)
    assert got == want
    assert jumped > 0


def test_two_nodes_on_localhost_equal_one_process(model_factory, tmp_path):
    path = model_factory("llama")
    want = outputs(path)
    addr = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--model-path", path, "--dtype",
                              "float32", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
                              addr], stdout=log, stderr=subprocess.STDOUT)
    try:
        got = outputs(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        assert node1.wait(timeout=60) == 0  # node 0's engine stopped: node 1's ranks end
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()
    assert got == want


def test_a_dead_rank_ends_the_engine_with_a_message(model_factory):
    path = model_factory("llama")
    e = Engine(model_path=path, tp_size=2, **ENGINE)
    try:
        e.generate(PROMPTS[0], greedy(4))
        follower = e.loop.scheduler.runner.tp_leader.procs[1]
        follower.kill()
        follower.wait()
        start = time.monotonic()
        out = e.generate(PROMPTS[0], greedy(4))
        assert time.monotonic() - start < 30
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "rank 1 exited" in out["meta_info"]["finish_reason"]["message"]
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            e.generate(PROMPTS[0], greedy(4))
    finally:
        e.shutdown()
