"""SGLang's own speculative-decoding tests, ported to specserve on CPU with tiny random models.

Sources (in sgl-project/sglang): ``test/registered/spec/eagle/test_eagle_infer_a.py`` (offline Engine),
``test_eagle_infer_b.py`` (EagleServerBase), ``test_eagle_infer_beta.py`` (spec v2 / overlap, with
MatchedStopMixin), the kits ``sglang/test/kits/spec_server_kits.py`` (SpecParityKit, SpecCorrectnessKit,
SpecLogprobKit, SpecPenaltyKit, SpecFeatureKit), ``kits/logprob_kit.py`` (LogprobCrossModeMixin),
``kits/radix_cache_server_kit.py``, ``kits/matched_stop_kit.py``, ``test_standalone_speculative_decoding.py``,
``test_ngram_speculative_decoding.py`` and the MTP tests (MiMo's documented EAGLE 1/1/2 launch).

Every algorithm gets its own real server (``python -m specserve.launch_server``), launched with the flags SGLang's
test passes (``--cuda-graph-max-bs`` / ``--cuda-graph-bs`` are no-ops on CPU, ``--mem-fraction-static`` sizes the
KV cache from the CPU budget, ``--attention-backend`` runs on SDPA) plus ``--dtype float32 --device cpu``
(``popen_launch_server`` appends ``--device``; float32 so logprobs can be compared tightly) and
``--num-threads 1`` (as tests/server/conftest.py's start_server, on a shared 2-core box):

- EAGLE: EagleServerBase (steps 5, topk 8, 64 draft tokens: a topk>1 tree) + TestEAGLEServerBasic's extras.
- EAGLE3: TestEagle3ServerBase of test_eagle_infer_beta (steps 5, topk 1, 6 tokens, the short alias
  ``--speculative-draft-model``) with ``SGLANG_ENABLE_SPEC_V2=1`` (the overlap scheduler, as older versions set).
- STANDALONE: DEFAULT_SERVER_ARGS (steps 4, topk 2, 7 tokens: a tree), the draft being the target itself.
- STANDALONE_V2: the V2 args (topk 1, 5 tokens: a chain) with ``SGLANG_ENABLE_SPEC_V2=True``.
- NGRAM: ``--speculative-num-draft-tokens 16`` (no draft model).
- MTP: EAGLE with no draft path on a MiMo-style target (MTP layers in the checkpoint), steps 1, topk 1, 2 tokens.

Targets and drafts come from specserve.test.tiny, built so the drafts are mostly accepted (an EAGLE head that
mirrors a one-layer target, an EAGLE3 head that mirrors a bigram target, MiMo MTP layers that mirror the body, a
STANDALONE draft equal to the target, NGRAM on a model that falls into loops). Each server also gets
``--disable-speculative-auto-off`` (specserve's own flag, not SGLang's): without it specserve measures per batch
size whether plain steps are faster and, on these tiny models, often runs plain steps, which would make the
drafting guards below meaningless.

Where SGLang measures accuracy (gsm8k, mmlu) or an accept-length threshold on a real model, these ports check
instead that greedy output equals plain (non-speculative) greedy decoding of the same target token for token
(the plain reference is an offline ``specserve.Engine`` without speculation, as test_eagle_infer_a's reference
engine), plus a drafting guard: verify steps ran (spec_verify_ct > 0) and drafted tokens were accepted
(completion_tokens / spec_verify_ct > 1 and /server_info ``internal_states[0].avg_spec_accept_length`` > 1).
Token lengths, prompts' token ids and probe ids are scaled to the tiny models (vocabulary 512, context 1024).

Not ported (no CPU meaning here):
- GPU kernels and backends: the ``--attention-backend`` fa3 / triton / flashinfer / flashinfer-MLA variants are one
  CPU path (the flag is accepted and runs on SDPA, as the EAGLE and EAGLE3 servers here show), torch-compile
  variants, ``test_eagle_sampling_filters`` / tree-building kernel unit tests (sgl_kernel), ROCm / XPU / FP4.
- ``--page-size`` > 1 variants (TestEAGLEServerPageSize*, TestEagle3ServerPage, NGRAM Paged, TestEAGLERadixCache's
  page configs): specserve's KV cache is token-granular; the flag is accepted (page size 1 is SGLang's default,
  as the EAGLE3 server passes) and a larger page runs token-granular, so those variants repeat the same test.
- TP / DP / EP and multi-GPU: DP-attention spec tests, DeepSeek-V3 MTP with ``--tp 8``, PP.
- Hidden states (SpecHiddenStatesKit, ``--enable-return-hidden-states``): not implemented in specserve.
- FR-Spec token maps on Llama-3 (TestEAGLEEngineTokenMap) and test_eagle_reject_sampling (a 9B model, TP 2).
- Retraction / strict memory-check env knobs (SGLANG_TEST_RETRACT, SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY),
  waiting / running timeouts, abort_all, NGRAM external-corpus endpoints: specserve-side tests cover what exists.
- test_spec_v2.py's KL test between v2 and v1 over 512-token samples: replaced by the exact parity of both modes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests
import transformers

from specserve import Engine
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir, make_mimo_dir
from specserve.utils import free_port, terminate_process, wait_for_server
from tests.server.conftest import Server, server_env
from tests.server.helpers import poll, sse_json

CONTEXT = 1024
CPU_FLAGS = ("--dtype", "float32", "--device", "cpu", "--num-threads", "1")
ALWAYS_SPECULATE = ("--disable-speculative-auto-off",)
LOGPROB_TOL = 1e-4  # SGLang: 0.255 / 0.5 / places=2 on bf16 GPUs; float32 on CPU measured about 1e-6

# SGLang's prompts
REF_PROMPT = "Today is a sunny day and I like"  # test_eagle_infer_a setUp / _test_single_generation
BATCH_PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
                 "The future of AI is"]  # _test_batch_generation / SpecCorrectnessKit.test_batch_generation
PARITY_PROMPTS = ["The capital of France is", "Once upon a time, there was a", "The three primary colors are",
                  "def fibonacci(n):"]  # SpecParityKit
EOS_PROMPT = ("[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\nToday is a sunny day and I like "
              "[/INST]")  # _test_eos_token
FASTAPI_PROMPT = "Human: Give me a fully functional FastAPI server. Show the python code.\n\nAssistant:"
PENALTY_PROMPT = "Human: Write a travel blog post to Hawaii.\n\nAssistant:"  # test_penalty_mixed's run_decode
LOGPROB_PROMPTS = ["The capital of France is", "Explain quantum computing in simple terms:",
                   "Today is a sunny day and I like"]  # LogprobCrossModeMixin / test_logprob_spec_v2_match
STORY_PROMPT = ("Please write an extremely detailed and vivid fantasy story, set in a world full of intricate "
                "magic systems, political intrigue, and complex characters.")  # MatchedStopMixin (its first line)
PROBE_IDS = [1, 2, 10, 100, 500]  # SGLang probes [1, 2, 10, 100, 1000]; 1000 is outside the 512-token vocabulary
PENALTY_SETS = [  # test_penalty_mixed's 14 sampling-param dicts
    {}, {}, {},
    {"frequency_penalty": 2},
    {"presence_penalty": 1},
    {"min_new_tokens": 16},
    {"frequency_penalty": 0.2},
    {"presence_penalty": 0.4},
    {"min_new_tokens": 8},
    {"frequency_penalty": 0.4, "presence_penalty": 0.8},
    {"frequency_penalty": 0.4, "min_new_tokens": 12},
    {"presence_penalty": 0.8, "min_new_tokens": 12},
    {"presence_penalty": -0.3, "frequency_penalty": 1.3, "min_new_tokens": 32},
    {"presence_penalty": 0.3, "frequency_penalty": -1.3, "min_new_tokens": 32},
]


# ---------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def models(model_factory, tokenizer_dir, tmp_path_factory) -> dict:
    """Targets and drafts that accept most drafted tokens (see the module docstring)."""
    root = tmp_path_factory.mktemp("spec-ports-models")
    mirror = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=CONTEXT)
    bigram = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True,
                           max_position_embeddings=CONTEXT)
    return {
        "mirror": mirror,
        "bigram": bigram,
        "eagle": make_eagle_head_dir(str(root / "eagle"), mirror, kind="self"),
        "eagle3": make_eagle3_head_dir(str(root / "eagle3"), bigram, kind="self"),
        "mimo": make_mimo_dir(str(root / "mimo"), kind="self", tokenizer_dir=tokenizer_dir,
                              max_position_embeddings=CONTEXT),
    }


def _case(name: str, m: dict) -> tuple[str, list[str], dict]:
    """(target, SGLang's launch flags for `name`, extra environment)."""
    if name == "EAGLE":  # test_eagle_infer_b EagleServerBase + TestEAGLEServerBasic
        return m["mirror"], ["--speculative-algorithm=EAGLE", f"--speculative-draft-model-path={m['eagle']}",
                             "--speculative-num-steps=5", "--speculative-eagle-topk=8",
                             "--speculative-num-draft-tokens=64", "--mem-fraction-static=0.7",
                             "--chunked-prefill-size", "128", "--max-running-requests", "8", "--attention-backend",
                             "fa3"], {}
    if name == "EAGLE3":  # test_eagle_infer_beta TestEagle3ServerBase (older versions: SGLANG_ENABLE_SPEC_V2=1)
        return m["bigram"], ["--trust-remote-code", "--chunked-prefill-size", "1024", "--speculative-algorithm",
                             "EAGLE3", "--speculative-draft-model", m["eagle3"], "--speculative-num-steps", "5",
                             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6",
                             "--mem-fraction-static", "0.75", "--max-running-requests", "64", "--page-size", "1",
                             "--attention-backend", "triton", "--cuda-graph-bs", *map(str, range(1, 9))], \
            {"SGLANG_ENABLE_SPEC_V2": "1"}
    if name in ("STANDALONE", "STANDALONE_V2"):  # test_standalone_speculative_decoding DEFAULT_SERVER_ARGS / V2
        topk, tokens = ("2", "7") if name == "STANDALONE" else ("1", "5")
        env = {} if name == "STANDALONE" else {"SGLANG_ENABLE_SPEC_V2": "True"}
        return m["mirror"], ["--trust-remote-code", "--cuda-graph-max-bs", "8", "--speculative-algorithm",
                             "STANDALONE", "--speculative-draft-model-path", m["mirror"],
                             "--speculative-num-steps", "4", "--speculative-eagle-topk", topk,
                             "--speculative-num-draft-tokens", tokens, "--mem-fraction-static", "0.7"], env
    if name == "NGRAM":  # test_ngram_speculative_decoding
        return m["mirror"], ["--trust-remote-code", "--cuda-graph-max-bs", "8", "--speculative-algorithm", "NGRAM",
                             "--speculative-num-draft-tokens", "16", "--mem-fraction-static", "0.8"], {}
    assert name == "MTP"  # MiMo's documented launch: EAGLE, no draft path, steps 1 topk 1 tokens 2
    return m["mimo"], ["--trust-remote-code", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
                       "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"], {}


CASES = ["EAGLE", "EAGLE3", "STANDALONE", "STANDALONE_V2", "NGRAM", "MTP"]
V2_CASES = {"EAGLE3", "STANDALONE_V2"}


def launch(model_dir: str, log_path: str, flags: list[str], env: dict) -> Server:
    """tests.server.conftest.start_server with an extra environment (SGLANG_ENABLE_SPEC_V2)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.launch_server", "--model-path", model_dir, "--port", str(port), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**server_env(), **env})
    server = Server(proc, f"http://127.0.0.1:{port}", model_dir, log_path)
    try:
        wait_for_server(server.url, timeout=300, process=proc)
    except Exception:
        terminate_process(proc)
        raise RuntimeError("server did not start:\n" + server.log()) from None
    return server


@dataclass
class Spec:
    name: str
    server: Server
    target: str
    tokenizer: object

    def generate(self, body: dict, timeout: float = 120):
        r = requests.post(self.server.url + "/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def state(self) -> dict:
        return self.server.get("/server_info").json()["internal_states"][0]


@pytest.fixture(scope="module", params=CASES)
def spec(request, models, tmp_path_factory):
    target, flags, env = _case(request.param, models)
    log = str(tmp_path_factory.mktemp(f"spec-{request.param.lower()}") / "server.log")
    server = launch(target, log, [*flags, *CPU_FLAGS, *ALWAYS_SPECULATE], env)
    yield Spec(request.param, server, target, transformers.AutoTokenizer.from_pretrained(target))
    terminate_process(server.proc)


class Reference:
    """Plain (non-speculative) greedy decoding of each target with an offline Engine, memoised per request."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.memo: dict[str, list[dict]] = {}

    def __call__(self, target: str, prompts=None, params=None, input_ids=None) -> list[dict]:
        key = json.dumps([target, prompts, params, input_ids])
        if key not in self.memo:
            if target not in self.engines:
                self.engines[target] = Engine(model_path=target, dtype="float32", device="cpu")
            outs = self.engines[target].generate(prompts, params, input_ids=input_ids)
            self.memo[key] = outs if isinstance(outs, list) else [outs]
        return self.memo[key]

    def close(self) -> None:
        for e in self.engines.values():
            e.shutdown()


@pytest.fixture(scope="module")
def reference():
    ref = Reference()
    yield ref
    ref.close()


def greedy(n: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": n, **extra}


def assert_drafted(metas: list[dict]) -> None:
    """The drafting guard on the requests' meta_info (SpecCorrectnessKit.test_batch_generation's measure)."""
    verify = sum(m["spec_verify_ct"] for m in metas)
    assert verify > 0, "no verify step ran"
    assert sum(m["completion_tokens"] for m in metas) / verify > 1, metas


def assert_server_drafted(spec: Spec) -> None:
    """The drafting guard on /server_info (test_gsm8k's internal_states[0].avg_spec_accept_length)."""
    state = spec.state()
    assert state["spec_verify_ct"] > 0 and state["avg_spec_accept_length"] > 1, state


def ids_of(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


# ---------------------------------------------------------------------------------------------- parity
def test_parity_vs_reference(spec, reference):
    """Ports SpecParityKit.test_parity_vs_reference (greedy 48 tokens per prompt == the non-spec reference server),
    test_eagle_infer_a's _test_single_generation (REF_PROMPT, 8 tokens, text == reference text) and
    _test_batch_generation (4 prompts in one batch, 50 tokens), and, as PORT-AS-PARITY, test_gsm8k's accuracy and
    accept-length thresholds (all algorithms): equal to plain decoding plus the drafting guard."""
    want = reference(spec.target, REF_PROMPT, greedy(8))[0]
    got = spec.generate({"text": REF_PROMPT, "sampling_params": greedy(8)})
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]

    want = reference(spec.target, PARITY_PROMPTS, greedy(48))
    singles = [spec.generate({"text": p, "sampling_params": greedy(48)}) for p in PARITY_PROMPTS]
    assert [o["text"] for o in singles] == [o["text"] for o in want]
    assert ids_of(singles) == ids_of(want)

    want = reference(spec.target, BATCH_PROMPTS, greedy(50))
    batch = spec.generate({"text": BATCH_PROMPTS, "sampling_params": greedy(50)})
    assert ids_of(batch) == ids_of(want) and [o["text"] for o in batch] == [o["text"] for o in want]
    assert_drafted([o["meta_info"] for o in singles + batch])
    assert_server_drafted(spec)
    if spec.name in V2_CASES:  # SGLANG_ENABLE_SPEC_V2 really turned the overlap scheduler on
        state = spec.state()
        assert state["spec_overlap"] is True and state["spec_overlapped_steps"] > 0, state


def test_flush_cache_then_parity(spec, reference):
    """Ports the GET /flush_cache that test_gsm8k (EAGLE, STANDALONE, NGRAM) and TestEAGLEDraftExtend run first
    (200), and TestEAGLEDraftExtend.test_one_batch_accept_length: the 4-prompt batch (512 tokens there, 128
    here) returns 200, equals plain decoding and each request's completion_tokens / spec_verify_ct > 1 (SGLang:
    > 1.5 on its trained draft)."""
    assert requests.get(spec.server.url + "/flush_cache", timeout=60).status_code == 200
    assert requests.post(spec.server.url + "/flush_cache", timeout=60).status_code == 200
    want = reference(spec.target, BATCH_PROMPTS, greedy(128))
    got = spec.generate({"text": BATCH_PROMPTS, "sampling_params": greedy(128)})
    assert ids_of(got) == ids_of(want)
    for o in got:
        assert o["meta_info"]["cached_tokens"] == 0  # the flush really emptied the prefix cache
        assert_drafted([o["meta_info"]])


def test_eos_token(spec):
    """Ports _test_eos_token / SpecCorrectnessKit.test_eos_token: temperature 0.1, skip_special_tokens False; the
    EOS token must not be emitted as text (re-tokenizing the output finds no EOS id). A random model never
    samples EOS by itself, so EOS gets a +100 logit_bias and min_new_tokens 2 / 5 / 9 holds it back: each
    request finishes on the EOS id (matched, last output id, counted) inside a speculative run."""
    tok, eos = spec.tokenizer, spec.tokenizer.eos_token_id
    eos_text = tok.convert_ids_to_tokens(eos)
    holds = [2, 5, 9]
    params = [{"temperature": 0.1, "max_new_tokens": 256, "skip_special_tokens": False,
               "logit_bias": {str(eos): 100.0}, "min_new_tokens": k} for k in holds]
    outs = spec.generate({"text": [EOS_PROMPT] * len(holds), "sampling_params": params})
    for k, o in zip(holds, outs, strict=True):
        meta = o["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": eos}
        assert meta["completion_tokens"] == k + 1 == len(o["output_ids"])
        assert o["output_ids"][-1] == eos and eos not in o["output_ids"][:-1]
        assert eos_text not in o["text"]
        assert eos not in tok.encode(o["text"], add_special_tokens=False)
        assert o["text"] == tok.decode(o["output_ids"][:-1], skip_special_tokens=False)


def test_first_token_finish(spec, reference):
    """Ports SpecCorrectnessKit.test_first_token_finish: 8 prompts in one batch, each with max_new_tokens
    randint(1, 3); every result has text. Also: each result is plain decoding's for the same request."""
    rng = random.Random(0)
    prompts = BATCH_PROMPTS + PARITY_PROMPTS
    params = [greedy(rng.randint(1, 3)) for _ in prompts]
    assert {p["max_new_tokens"] for p in params} == {1, 2, 3}
    outs = spec.generate({"text": prompts, "sampling_params": params})
    want = reference(spec.target, prompts, params)
    for o, w, p in zip(outs, want, params, strict=True):
        assert "text" in o and o["meta_info"]["completion_tokens"] == p["max_new_tokens"]
        assert o["output_ids"] == w["output_ids"] and o["text"] == w["text"]


def test_max_token_one(spec, reference):
    """Ports test_max_token_one / SpecPerfKit (gsm8k with max_new_tokens 1, 128 in parallel; SGLang asserts a
    throughput, whose point is "no hang"): 200 concurrent requests of one token each all finish with
    completion_tokens 1 and plain decoding's token."""
    prompts = [f"Question {i}: Tom has {i} apples and eats one. How many are left?\nAnswer:" for i in range(200)]
    want = reference(spec.target, prompts, greedy(1))

    def one(prompt: str) -> dict:
        return spec.generate({"text": prompt, "sampling_params": greedy(1)})

    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(one, prompts))
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1] * len(prompts)
    assert ids_of(outs) == ids_of(want)


# ---------------------------------------------------------------------------------------------- logprobs
def test_logprob_start_len(spec):
    """Ports test_logprob_start_len (EagleServerBase / SpecLogprobKit, same as TestSRTEndpoint's): a batch of two
    texts, max_new_tokens 4, logprob_start_len 4, top 5: prompt_tokens == 4 + len(input_token_logprobs), the
    logged input texts are a suffix of the prompt, 4 output entries whose texts make up the output text."""
    prompts = ["I have a very good idea on", "Today is a sunndy day and"]
    outs = spec.generate({"text": prompts, "sampling_params": greedy(4), "return_logprob": True,
                          "top_logprobs_num": 5, "return_text_in_logprobs": True, "logprob_start_len": 4})
    for prompt, o in zip(prompts, outs, strict=True):
        meta = o["meta_info"]
        assert meta["prompt_tokens"] == 4 + len(meta["input_token_logprobs"])
        suffix = "".join(x[-1] for x in meta["input_token_logprobs"])
        assert prompt.endswith(suffix) and 0 < len(suffix) < len(prompt)
        assert meta["completion_tokens"] == 4 == len(meta["output_token_logprobs"])
        assert o["text"] == "".join(x[-1] for x in meta["output_token_logprobs"])


def _by_id(row: list | None) -> dict[int, float]:
    return {tid: lp for lp, tid, *_ in (row or [])}


def test_cross_mode_logprobs(spec):
    """Ports LogprobCrossModeMixin.test_cross_mode_logprobs, test_logprob_spec_v2_match (test_eagle_infer_beta) and
    SpecLogprobKit's prefill-rescore match: generate 32 greedy tokens (ignore_eos, top 5, token_ids_logprob
    probes, logprob_start_len 0), then re-score prompt + output with max_new_tokens 0: the output entries equal
    the re-scored ones (ids; values within 1e-4, measured about 1e-6; SGLang allows 0.255 / 0.5 / places=2 in
    bf16), the input entries too, the top-5 lists share ids whose values agree, and the probe rows have the same
    ids and values."""
    logprob_args = {"return_logprob": True, "top_logprobs_num": 5, "token_ids_logprob": PROBE_IDS,
                    "logprob_start_len": 0}
    worst = 0.0
    gens = spec.generate({"text": LOGPROB_PROMPTS, "sampling_params": greedy(32, ignore_eos=True), **logprob_args})
    for gen in gens:
        g = gen["meta_info"]
        n_prompt = g["prompt_tokens"]
        assert len(g["input_token_logprobs"]) == n_prompt and len(g["output_token_logprobs"]) == 32
        ids = [x[1] for x in g["input_token_logprobs"]] + gen["output_ids"]
        s = spec.generate({"input_ids": ids, "sampling_params": greedy(0, ignore_eos=True), **logprob_args})
        s = s["meta_info"]
        assert s["completion_tokens"] == 0 and len(s["input_token_logprobs"]) == len(ids)
        pairs = [(g["input_token_logprobs"], s["input_token_logprobs"][:n_prompt],
                  g["input_top_logprobs"], s["input_top_logprobs"][:n_prompt],
                  g["input_token_ids_logprobs"], s["input_token_ids_logprobs"][:n_prompt]),
                 (g["output_token_logprobs"], s["input_token_logprobs"][n_prompt:],
                  g["output_top_logprobs"], s["input_top_logprobs"][n_prompt:],
                  g["output_token_ids_logprobs"], s["input_token_ids_logprobs"][n_prompt:])]
        for tokens, re_tokens, top, re_top, probes, re_probes in pairs:
            assert len(tokens) == len(re_tokens) == len(top) == len(re_top) == len(probes) == len(re_probes)
            assert [x[1] for x in tokens] == [x[1] for x in re_tokens]
            for (lp, _, *_), (re_lp, _, *_) in zip(tokens, re_tokens, strict=True):
                if lp is None or re_lp is None:
                    assert lp is None and re_lp is None
                    continue
                worst = max(worst, abs(lp - re_lp))
            for row, re_row in zip(top, re_top, strict=True):
                a, b = _by_id(row), _by_id(re_row)
                if row is None:
                    continue
                assert len(a) == 5 and set(a) & set(b)
                worst = max([worst, *(abs(a[t] - b[t]) for t in set(a) & set(b))])
            for row, re_row in zip(probes, re_probes, strict=True):
                a, b = _by_id(row), _by_id(re_row)
                if row is None:
                    continue
                assert set(a) == set(b) == set(PROBE_IDS)
                worst = max([worst, *(abs(a[t] - b[t]) for t in a)])
    assert worst < LOGPROB_TOL, worst


def test_cross_mode_logprob_start_len(spec):
    """Ports LogprobCrossModeMixin.test_cross_mode_logprob_start_len: for start in {0, 1, P//2, P-1}:
    len(input_token_logprobs) == len(input_top_logprobs) == P - start, 8 output entries, prompt_tokens ==
    start + len(input_token_logprobs) (and the logged ids are the prompt's from `start`)."""
    prompt = LOGPROB_PROMPTS[1]
    prompt_ids = spec.generate({"text": prompt, "sampling_params": greedy(1), "return_logprob": True,
                                "logprob_start_len": 0})["meta_info"]["input_token_logprobs"]
    n = len(prompt_ids)
    for start in sorted({0, 1, n // 2, n - 1}):
        meta = spec.generate({"text": prompt, "sampling_params": greedy(8, ignore_eos=True), "return_logprob": True,
                              "top_logprobs_num": 5, "logprob_start_len": start})["meta_info"]
        assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"]) == n - start
        assert meta["prompt_tokens"] == start + len(meta["input_token_logprobs"])
        assert [x[1] for x in meta["input_token_logprobs"]] == [x[1] for x in prompt_ids[start:]]
        assert len(meta["output_token_logprobs"]) == 8 == len(meta["output_top_logprobs"])


def test_cross_mode_return_text_in_logprobs(spec):
    """Ports LogprobCrossModeMixin.test_cross_mode_return_text_in_logprobs: with return_text_in_logprobs every
    output triple (and every top-k and input triple) carries its text, never None."""
    outs = spec.generate({"text": LOGPROB_PROMPTS, "sampling_params": greedy(16, ignore_eos=True),
                          "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True,
                          "logprob_start_len": 0})
    for o in outs:
        meta = o["meta_info"]
        assert all(isinstance(x[2], str) for x in meta["output_token_logprobs"])
        assert all(isinstance(x[2], str) for row in meta["output_top_logprobs"] for x in row)
        assert all(isinstance(x[2], str) for x in meta["input_token_logprobs"])
        # each triple's text is its own token's (SGLang decodes ids one by one): byte-level pieces of one
        # character do not join back into the output text, so only the ids are tied to the output here
        assert [x[1] for x in meta["output_token_logprobs"]] == o["output_ids"]


def _logprob_check(spec: Spec, input_len, output_len, logprob_start_len, return_logprob, top_n) -> None:
    """SGLang's run_logprob_check at temperature 0."""
    meta = spec.generate({
        "input_ids": list(range(input_len)),
        "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True},
        "return_logprob": return_logprob, "logprob_start_len": logprob_start_len, "top_logprobs_num": top_n,
    })["meta_info"]
    assert meta["prompt_tokens"] == input_len and meta["completion_tokens"] == output_len
    if not return_logprob:
        return
    assert len(meta["input_token_logprobs"]) + logprob_start_len == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == output_len
    if not top_n:
        return
    assert len(meta["input_top_logprobs"]) + logprob_start_len == meta["prompt_tokens"]
    assert len(meta["output_top_logprobs"]) == output_len
    for entry, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == top_n
        rank = 0  # the greedy entry is the top-1 entry, up to exact ties
        while entry != top[rank]:
            assert rank + 1 < len(top) and top[rank][0] == top[rank + 1][0], (entry, top)
            rank += 1


def test_logprob_mixed(spec):
    """Ports test_logprob_mixed / SpecLogprobKit / LogprobCrossModeMixin.test_cross_mode_logprob_mixed:
    run_logprob_check over input_len x output_len x logprob_start_len x return_logprob x top_logprobs_num,
    8 at a time; lengths {200, 500, 1000, 2000} / starts {0, 100, 300, 800, 1998} scaled to
    {20, 50, 100, 200} / {0, 10, 30, 80, 198}."""
    grid = [(i, o, s, r, t) for i in (20, 50, 100, 200) for o in (4, 8) for s in (0, 10, 30, 80, 198)
            for r in (True, False) for t in (0, 5) if s < i]
    random.Random(0).shuffle(grid)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda args: _logprob_check(spec, *args), grid))


def test_token_ids_logprob_ragged(spec):
    """Ports test_token_ids_logprob_ragged (test_eagle_infer_beta / SpecLogprobKit): 8 concurrent requests whose
    token_ids_logprob lists have different lengths ("Hello world", 8 tokens, top 3): each returns text, and each
    output position's probe row holds exactly its own request's ids."""
    lists = [[1, 2], [3, 4, 5], [6], [10, 20, 30, 40], [7, 8], [100], [50, 60, 70], [200, 300, 400, 500, 11]]

    def one(probe: list[int]) -> tuple[list[int], dict]:
        return probe, spec.generate({"text": "Hello world", "sampling_params": greedy(8), "return_logprob": True,
                                     "top_logprobs_num": 3, "token_ids_logprob": probe})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, lists))
    for probe, o in results:
        assert "text" in o
        rows = o["meta_info"]["output_token_ids_logprobs"]
        assert len(rows) == o["meta_info"]["completion_tokens"] > 0
        assert all(sorted(x[1] for x in row) == sorted(probe) for row in rows)


# ---------------------------------------------------------------------------------------------- sampling params
def test_penalty_mixed(spec, reference):
    """Ports test_penalty_mixed (EagleServerBase / SpecPenaltyKit) and test_eagle_infer_beta's test_penalty: the 14
    sampling-param dicts sent concurrently (8 threads) through run_decode (PENALTY_PROMPT, 48 tokens, temperature
    0.7, logprobs with top 5, text in logprobs, logprob_start_len 0): all 200 and well-formed (min_new_tokens
    honoured, one logprob entry per token). Also the same dicts at temperature 0 equal plain decoding with the same
    penalties (penalties must see the accepted draft tokens)."""
    def run_decode(params: dict) -> dict:
        return spec.generate({"text": PENALTY_PROMPT,
                              "sampling_params": {"max_new_tokens": 48, "n": 1, "temperature": 0.7, **params},
                              "return_logprob": True, "top_logprobs_num": 5, "return_text_in_logprobs": True,
                              "logprob_start_len": 0})

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(run_decode, PENALTY_SETS))
    for params, o in zip(PENALTY_SETS, outs, strict=True):
        meta = o["meta_info"]
        assert isinstance(o["text"], str)
        assert params.get("min_new_tokens", 0) <= meta["completion_tokens"] <= 48
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == meta["completion_tokens"]
        assert all(len(row) == 5 for row in meta["output_top_logprobs"])
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]

    params = [greedy(48, **p) for p in PENALTY_SETS]
    got = spec.generate({"text": [PENALTY_PROMPT] * len(params), "sampling_params": params})
    assert ids_of(got) == ids_of(reference(spec.target, [PENALTY_PROMPT] * len(params), params))


def _radix_tree(vocab: int, num_nodes: int = 40, chunk_len: int = 16) -> list[dict]:
    """kits/radix_cache_server_kit.gen_radix_tree scaled down (SGLang: 400 nodes, chunks of up to 256, a root of
    [37] * 117 decoding 217): half the nodes extend a random node, the rest come in sibling groups of 1..10."""
    rng = random.Random(0)
    nodes = [{"input_ids": [37] * 20, "decode_len": 24}]

    def child(parent: dict) -> dict:
        unique_len, decode_len, token = rng.randint(0, chunk_len), rng.randint(0, chunk_len), rng.randint(0, vocab - 1)
        return {"input_ids": parent["input_ids"] + [token] * unique_len, "decode_len": decode_len}

    num0 = num_nodes // 2
    num1 = num_nodes - num0
    for _ in range(num0):
        nodes.append(child(rng.choice(nodes)))
    while num1 > 0:
        branch = rng.randint(1, min(num1, 10))
        parent = rng.choice(nodes)
        nodes.extend(child(parent) for _ in range(branch))
        num1 -= branch
    rng.shuffle(nodes)
    return nodes


def test_radix_attention(spec, reference):
    """Ports test_radix_attention (run_radix_attention_test; EagleServerBase Extend, test_eagle_infer_beta,
    SpecFeatureKit): one batched /generate of a random radix tree of prompts (input_ids lists) with per-request
    sampling_params (some max_new_tokens 0) returns 200 and the server stays alive. Also: every output equals plain
    decoding's for the same request."""
    nodes = _radix_tree(len(spec.tokenizer))
    assert any(n["decode_len"] == 0 for n in nodes)
    ids = [n["input_ids"] for n in nodes]
    params = [{"max_new_tokens": n["decode_len"], "temperature": 0} for n in nodes]
    outs = spec.generate({"input_ids": ids, "sampling_params": params})
    assert spec.server.proc.poll() is None
    assert requests.get(spec.server.url + "/health_generate", timeout=60).status_code == 200
    assert ids_of(outs) == ids_of(reference(spec.target, None, params, input_ids=ids))


def test_constrained_decoding(spec):
    """Ports test_constrained_decoding (SpecFeatureKit; SGLang skips it on CPU): a chat completion with
    response_format json_object at temperature 0 answers 200 with one choice whose content is a JSON object. SGLang
    loads it unconditionally; the random target may still be inside the object when it reaches the context, so
    the load applies when it finished ("stop"), and the content opens an object in any case. Drafting happened."""
    before = spec.state()["spec_verify_ct"]
    r = requests.post(spec.server.url + "/v1/chat/completions", timeout=300, json={
        "model": spec.server.model, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                 {"role": "user", "content": "Give me a json"}],
        "temperature": 0, "max_tokens": 200, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    res = r.json()
    assert len(res["choices"]) == 1 and "content" in res["choices"][0]["message"]
    content = res["choices"][0]["message"]["content"]
    assert content.lstrip().startswith("{"), content
    if res["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    assert spec.state()["spec_verify_ct"] > before


def test_request_abort(spec, reference):
    """Ports test_request_abort (EagleServerBase / SpecFeatureKit): 4 threads send 5 prompts one after another
    (greedy; 1024 tokens there, 128 here) while 4 threads send the same prompts with a 1 s client timeout (0.2 s
    here), i.e. client disconnects. Every request that was not cut off returns 200 -- and plain decoding's output
    -- and the server survives. These tiny models may finish before any timeout, so each impatient thread also
    hangs up on a streamed request (512 tokens) after its first chunk: a disconnect mid-generation every time.
    Afterwards nothing is left running or waiting."""
    prompts = [REF_PROMPT, *PARITY_PROMPTS]
    want = {p: w["output_ids"] for p, w in zip(prompts, reference(spec.target, prompts, greedy(128)), strict=True)}
    results: list[tuple[str, dict]] = []

    def patient(_: int) -> None:
        for p in prompts:
            results.append((p, spec.generate({"text": p, "sampling_params": greedy(128)})))

    def impatient(_: int) -> None:
        for p in prompts:
            with requests.post(spec.server.url + "/generate", stream=True, timeout=60,
                               json={"text": p, "sampling_params": greedy(512, ignore_eos=True), "stream": True}) as r:
                assert r.status_code == 200
                first = next(line for line in r.iter_lines() if line)
                assert first.startswith(b"data: {")
            try:
                r = requests.post(spec.server.url + "/generate", timeout=0.2,
                                  json={"text": p, "sampling_params": greedy(128)})
            except requests.exceptions.Timeout:
                continue
            assert r.status_code == 200, r.text
            results.append((p, r.json()))

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(patient, i) for i in range(4)] + [pool.submit(impatient, i) for i in range(4)]
        for f in futures:
            f.result()
    assert len(results) >= 20
    for p, o in results:
        assert o["output_ids"] == want[p]
    assert spec.server.proc.poll() is None
    poll(lambda: (lambda s: s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0)(spec.state()),
         timeout=60, what="the abandoned requests to leave the scheduler")
    assert requests.get(spec.server.url + "/health_generate", timeout=60).status_code == 200
    again = spec.generate({"text": prompts, "sampling_params": greedy(128)})
    assert ids_of(again) == [want[p] for p in prompts]


# ---------------------------------------------------------------------------------------------- matched stop
def _completion(spec: Spec, **body) -> dict:
    """MatchedStopMixin's completion request (temperature 0, top_p 1)."""
    r = requests.post(spec.server.url + "/v1/completions", timeout=120,
                      json={"model": spec.target, "prompt": STORY_PROMPT, "temperature": 0, "top_p": 1, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "matched_stop" in choice
    return {**choice, "usage": r.json()["usage"]}


def _stream_steps(spec: Spec, n: int) -> tuple[list[int], set[int]]:
    """Greedy output ids of STORY_PROMPT under speculation and where its steps ended (completion_tokens after
    each streamed chunk), from a /generate stream."""
    with requests.post(spec.server.url + "/generate", stream=True, timeout=120,
                       json={"text": STORY_PROMPT, "sampling_params": greedy(n), "stream": True}) as r:
        assert r.status_code == 200
        events = sse_json(r)
    return events[-1]["output_ids"], {e["meta_info"]["completion_tokens"] for e in events}


@pytest.fixture(scope="module")
def story(spec, reference):
    """(plain greedy ids of STORY_PROMPT, the ends of speculative steps) -- the same ids under speculation."""
    ids, ends = _stream_steps(spec, 64)
    assert ids == reference(spec.target, STORY_PROMPT, greedy(64))[0]["output_ids"]
    assert max(b - a for a, b in zip([0, *sorted(ends)], sorted(ends), strict=False)) > 1  # multi-token steps
    return ids, ends


def test_finish_stop_str_mid_draft(spec, story):
    """Ports MatchedStopMixin.test_finish_stop_str under speculation (test_eagle_infer_beta mixes it in): a stop
    string whose last token is followed by more accepted tokens of the same speculative step (so it lands inside
    an accepted draft) -> finish_reason "stop", matched_stop the string, text cut before the stop string, and
    completion_tokens counting the tokens through the stop."""
    ids, ends = story
    tok = spec.tokenizer
    k = next((k for k in range(4, len(ids) - 2)
              if k + 2 not in ends  # token k + 1 is not the last of its step
              and (s := tok.decode(ids[k:k + 2])).strip() and s.isprintable() and s.isascii()
              and tok.decode(ids).find(s) == len(tok.decode(ids[:k]))
              and tok.decode(ids).startswith(tok.decode(ids[:k]))), None)
    assert k is not None, f"precondition: no stop string lands mid-step in {ids} (steps end at {sorted(ends)})"
    stop = tok.decode(ids[k:k + 2])
    choice = _completion(spec, max_tokens=64, stop=stop)
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
    assert choice["text"] == tok.decode(ids[:k])
    assert choice["usage"]["completion_tokens"] == k + 2


def test_finish_stop_token_mid_draft(spec, story):
    """Ports MatchedStopMixin.test_finish_stop_eos's int-matched path with a stop token the model emits inside a
    speculative step (stop_token_ids): matched_stop the integer id, the stop token counted but not in the
    text."""
    ids, ends = story
    k = next((k for k in range(4, len(ids) - 1)
              if k + 1 not in ends and ids[k] not in ids[:k] and ids[k] not in spec.tokenizer.all_special_ids), None)
    assert k is not None, f"precondition: no new token mid-step in {ids} (steps end at {sorted(ends)})"
    choice = _completion(spec, max_tokens=64, stop_token_ids=[ids[k]])
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == ids[k] and isinstance(choice["matched_stop"], int)
    assert choice["usage"]["completion_tokens"] == k + 1
    assert choice["text"] == spec.tokenizer.decode(ids[:k])


def test_finish_stop_eos(spec):
    """Ports MatchedStopMixin.test_finish_stop_eos: a completion ending on EOS -> finish_reason "stop", matched_stop
    the integer EOS id (SGLang: Llama-3's; here the tiny model's). EOS is made greedy with a +100 logit_bias and
    held back 4 tokens with min_tokens; max_tokens 512 (SGLang 1000) fits the 1024-token context."""
    eos = spec.tokenizer.eos_token_id
    choice = _completion(spec, max_tokens=512, logit_bias={str(eos): 100}, min_tokens=4)
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == eos and isinstance(choice["matched_stop"], int)
    assert choice["usage"]["completion_tokens"] == 5


def test_finish_length(spec):
    """Ports MatchedStopMixin.test_finish_length: max_tokens 5 -> finish_reason "length", matched_stop null (the
    key present), 5 tokens although a speculative step may accept past the fifth."""
    choice = _completion(spec, max_tokens=5)
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert choice["usage"]["completion_tokens"] == 5


# ---------------------------------------------------------------------------------------------- offline Engine
ENGINE_CONFIGS = {
    # TestEAGLEEngine: steps 5, topk 4, 8 draft tokens; NUM_CONFIGS=2 (the base config, chunked_prefill_size=4)
    "EAGLE": ("mirror", "eagle", "EAGLE", 5, 4, 8, {}),
    "EAGLE-chunked4": ("mirror", "eagle", "EAGLE", 5, 4, 8, {"chunked_prefill_size": 4}),
    # TestEAGLE3Engine: topk 16, 64 draft tokens
    "EAGLE3": ("bigram", "eagle3", "EAGLE3", 5, 16, 64, {}),
    "EAGLE3-chunked4": ("bigram", "eagle3", "EAGLE3", 5, 16, 64, {"chunked_prefill_size": 4}),
    # TestEAGLERadixCache: EAGLE3 steps 2, topk 2, 5 tokens; its configs without page sizes: base and chunked 64
    "EAGLE3-radix": ("bigram", "eagle3", "EAGLE3", 2, 2, 5, {}),
    "EAGLE3-radix-chunked64": ("bigram", "eagle3", "EAGLE3", 2, 2, 5, {"chunked_prefill_size": 64}),
    # TestEAGLEDraftExtend: steps 1, topk 1, 2 tokens, --max-running-requests 4
    "EAGLE-draft-extend": ("mirror", "eagle", "EAGLE", 1, 1, 2, {"max_running_requests": 4}),
    # MTP with the draft inside the target checkpoint (no draft path), on the MiMo-style target:
    # test_mla_deepseek_v3 TestDeepseekV3MTP (steps 2, topk 4, 4 tokens, --disable-radix, --cuda-graph-max-bs 2)
    "MTP-dsv3": ("mimo", None, "EAGLE", 2, 4, 4, {"disable_radix_cache": True, "cuda_graph_max_bs": 2}),
    # test_deepseek_v3_mtp (steps 3, topk 1, 4 tokens), and NEXTN, SGLang's MTP name (test_eagle_reject_sampling)
    "MTP-dsv3-nightly": ("mimo", None, "EAGLE", 3, 1, 4, {}),
    "MTP-NEXTN": ("mimo", None, "NEXTN", 1, 1, 2, {}),
}


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_engine_correctness(config, models, reference):
    """Ports test_eagle_infer_a's TestEAGLEEngine.test_correctness (and TestEAGLE3Engine, TestEAGLERadixCache,
    TestEAGLEDraftExtend's launch, and the MTP launches of test_mla_deepseek_v3 / test_deepseek_v3_mtp, whose
    gsm8k and accept thresholds become the same checks) on the offline Engine, with SGLang's engine kwargs
    (mem_fraction_static 0.7, cuda_graph_max_bs 5, trust_remote_code): _test_single_generation (text == the
    non-spec reference engine's), _test_batch_generation (equal to plain; avg_spec_accept_length > 1, SGLang
    > 1.9 / 1.75), _test_eos_token (no EOS text in the output), _test_acc_length (the FastAPI prompt, 128 tokens
    instead of 512: equal to plain, completion_tokens / spec_verify_ct > 1, SGLang > 3.6 / 3.1; with chunked
    prefill, the prompt took one prefill step per chunk), TestEAGLERadixCache's repeat (the batch again, from the
    prefix cache when it is on, with the same output), then flush_cache as the alive check."""
    target_key, draft_key, algorithm, steps, topk, tokens, extra = ENGINE_CONFIGS[config]
    target = models[target_key]
    tok = transformers.AutoTokenizer.from_pretrained(target)
    kwargs = {"mem_fraction_static": 0.7, "cuda_graph_max_bs": 5, **extra}
    if draft_key is not None:
        kwargs["speculative_draft_model_path"] = models[draft_key]
    with Engine(model_path=target, dtype="float32", device="cpu", speculative_algorithm=algorithm,
                speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                trust_remote_code=True, disable_speculative_auto_off=True, **kwargs) as engine:
        # _test_single_generation
        assert engine.generate(REF_PROMPT, greedy(8))["text"] == reference(target, REF_PROMPT, greedy(8))[0]["text"]
        # _test_batch_generation
        batch = engine.generate(BATCH_PROMPTS, greedy(50))
        assert ids_of(batch) == ids_of(reference(target, BATCH_PROMPTS, greedy(50)))
        assert engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"] > 1
        # _test_eos_token
        eos = tok.eos_token_id
        out = engine.generate(EOS_PROMPT, {"temperature": 0.1, "max_new_tokens": 256, "skip_special_tokens": False,
                                           "logit_bias": {str(eos): 100.0}, "min_new_tokens": 6})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert eos not in tok.encode(out["text"], add_special_tokens=False)
        assert tok.convert_ids_to_tokens(eos) not in out["text"]
        # _test_acc_length
        prefills = engine.get_server_info()["num_prefill_steps"]
        out = engine.generate(FASTAPI_PROMPT, greedy(128))
        assert out["output_ids"] == reference(target, FASTAPI_PROMPT, greedy(128))[0]["output_ids"]
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["completion_tokens"] / meta["spec_verify_ct"] > 1
        if "chunked_prefill_size" in extra:  # the prompt really was prefilled in chunks of that size
            uncached = meta["prompt_tokens"] - meta["cached_tokens"]
            chunks = -(-uncached // extra["chunked_prefill_size"])
            assert engine.get_server_info()["num_prefill_steps"] - prefills >= chunks
        # TestEAGLERadixCache: the same batch again comes from the prefix cache (when on) and is unchanged
        again = engine.generate(BATCH_PROMPTS, greedy(50))
        assert ids_of(again) == ids_of(batch)
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        assert all(c == 0 for c in cached) if extra.get("disable_radix_cache") else all(c > 0 for c in cached)
        assert engine.flush_cache() is True


def test_server_accepts_sglang_spec_flags(spec, models):
    """The launch flags SGLang's spec tests pass reach the server as given: the speculative settings (the draft
    through ``--speculative-draft-model`` for EAGLE3, as test_eagle_infer_beta spells it) and the memory /
    cuda-graph / chunking / batch flags that are no-ops or limits on CPU."""
    info = spec.server.get("/server_info").json()
    _, flags, _ = _case(spec.name, models)
    assert {k: info[k] for k in EXPECTED_INFO[spec.name]} == EXPECTED_INFO[spec.name], flags
    draft = {"EAGLE": models["eagle"], "EAGLE3": models["eagle3"], "STANDALONE": models["mirror"],
             "STANDALONE_V2": models["mirror"]}.get(spec.name)
    assert info["speculative_draft_model_path"] == draft


EXPECTED_INFO = {
    "EAGLE": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 5, "speculative_eagle_topk": 8,
              "speculative_num_draft_tokens": 64, "mem_fraction_static": 0.7, "chunked_prefill_size": 128,
              "max_running_requests": 8},
    "EAGLE3": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 5, "speculative_eagle_topk": 1,
               "speculative_num_draft_tokens": 6, "mem_fraction_static": 0.75, "chunked_prefill_size": 1024,
               "max_running_requests": 64, "trust_remote_code": True},
    "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 4, "speculative_eagle_topk": 2,
                   "speculative_num_draft_tokens": 7, "mem_fraction_static": 0.7, "cuda_graph_max_bs": 8},
    "STANDALONE_V2": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 4,
                      "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5, "mem_fraction_static": 0.7,
                      "cuda_graph_max_bs": 8},
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 16, "mem_fraction_static": 0.8,
              "cuda_graph_max_bs": 8},
    "MTP": {"speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2},
}
