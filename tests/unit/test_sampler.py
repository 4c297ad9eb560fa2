import math

import pytest
import torch

from specserve.sampling import SamplingBatchInfo, SamplingParams, sample
from specserve.sampling import sampler as sampler_mod
from specserve.sampling.race import position_key
from specserve.sampling.sampler import (
    apply_penalties_and_bias,
    compute_logprobs,
    greedy_ids,
    is_plain_sampled,
    probs_from_logits,
    sample_inverse_cdf,
)
from tests.unit.race_reference import reference_exponential


def make_info(params, vocab_size, generators=None, prompt_ids=None, output_ids=None, stop_ids=None):
    B = len(params)
    return SamplingBatchInfo.from_params(
        [p.normalize() for p in params],
        generators if generators is not None else [None] * B,
        prompt_ids if prompt_ids is not None else [[] for _ in range(B)],
        output_ids if output_ids is not None else [[] for _ in range(B)],
        stop_ids if stop_ids is not None else [set() for _ in range(B)],
        vocab_size,
        "cpu",
    )


def gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


# Distribution p = [0.4, 0.3, 0.2, 0.1] at temperature 1.
P4 = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS4 = P4.log().view(1, 4)


# ---------------------------------------------------------------- batch info


def test_from_params_common_path_has_no_penalty_tensors():
    info = make_info([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)], 6,
                     generators=[gen(0), gen(1)])
    assert info.rep_penalties is None and info.freq_penalties is None and info.pres_penalties is None
    assert info.output_counts is None and info.seen_mask is None
    assert info.logit_bias is None and info.min_tokens_mask is None
    assert not (info.need_top_k or info.need_top_p or info.need_min_p)
    assert info.temperatures.shape == (2, 1) and info.temperatures.dtype == torch.float32
    assert info.temperatures.view(-1).tolist() == pytest.approx([0.7, 1.0])  # greedy row holds 1.0
    assert info.top_ks.tolist() == [6, 6] and info.top_ks.dtype == torch.int64
    assert info.is_greedy.tolist() == [False, True]
    assert not info.all_greedy
    assert info.generators[0] is not None and info.generators[1] is None  # greedy rows drop theirs


def test_from_params_flags_ignore_greedy_rows():
    info = make_info([SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2, top_k=3), SamplingParams()], 10)
    assert not (info.need_top_k or info.need_top_p or info.need_min_p)
    info = make_info([SamplingParams(top_k=3), SamplingParams(top_k=50)], 10)
    assert info.need_top_k and info.top_ks.tolist() == [3, 10]


# ---------------------------------------------------------------- greedy


def test_greedy_ids_by_hand_first_maximum_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0],    # tie: the first of the two maxima
                           [5.0, -1.0, 5.0, 5.0],   # three-way tie at the front
                           [-3.0, -2.0, -9.0, -2.5],
                           [1.0, float("nan"), 3.0, float("nan")]])  # NaN counts as the maximum, as in argmax
    assert greedy_ids(logits).tolist() == [1, 0, 1, 1]
    assert greedy_ids(logits.to(torch.bfloat16)).tolist() == [1, 0, 1, 1]
    assert greedy_ids(logits.view(2, 2, 4)).tolist() == [[1, 0], [1, 1]]  # verify logits [B, N, V]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_equal_argmax_on_vocabulary_sized_rows(dtype):
    """Wide rows with many ties, where the CPU reduction splits the row between threads."""
    torch.manual_seed(0)
    logits = torch.randint(-3, 4, (16, 32000)).to(dtype)
    logits[3, 20000] = 9.0
    logits[5, 31999] = 9.0
    ids = greedy_ids(logits)
    assert ids[3] == 20000 and ids[5] == 31999
    assert torch.equal(ids, logits.argmax(dim=-1))


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=1e-8),
              SamplingParams(temperature=0.0)]
    info = make_info(params, 32)
    assert info.all_greedy
    out = sample(logits, info)
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_all_greedy_skips_sampling_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("sampling work done for an all-greedy batch")

    monkeypatch.setattr(sampler_mod, "probs_from_logits", boom)
    monkeypatch.setattr(torch, "multinomial", boom)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample(logits, make_info([SamplingParams(temperature=0.0)] * 2, 3)).tolist() == [1, 0]


def test_greedy_row_in_mixed_batch_is_argmax_and_one_hot():
    torch.manual_seed(1)
    logits = torch.randn(3, 16)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)]
    info = make_info(params, 16, generators=[gen(1), gen(2), gen(3)])
    for _ in range(20):
        assert sample(logits, info)[1].item() == logits[1].argmax().item()
    probs = probs_from_logits(logits, info)
    expected = torch.zeros(16)
    expected[logits[1].argmax()] = 1.0
    assert torch.equal(probs[1], expected)


# ---------------------------------------------------------------- penalties and bias


def test_penalties_match_hand_computed_values():
    # vocab of 5; prompt = [0]; output so far = [1, 3, 3]
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # batch mate without penalties must be untouched
    ]
    info = make_info(params, 5, prompt_ids=[[0], [0]], output_ids=[[1, 3, 3], [1, 3, 3]])
    out = apply_penalties_and_bias(logits, info)
    # repetition (seen = {0, 1, 3}): 2/2 = 1.0, -1*2 = -2.0, 3/2 = 1.5
    # frequency (counts t1=1, t3=2, times 0.5): t1 -2.0-0.5 = -2.5, t3 1.5-1.0 = 0.5
    # presence (t1, t3 present, 0.25): t1 -2.75, t3 0.25 ; token 0 is only in the prompt: no freq/presence
    assert out[0].tolist() == pytest.approx([1.0, -2.75, 0.5, 0.25, -2.0])
    assert out[1].tolist() == logits[1].tolist()
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # input untouched


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"repetition_penalty": 0.5}, [4.0, -0.5, 0.5, 6.0, -2.0]),  # < 1 encourages repeats
        ({"frequency_penalty": -1.0}, [2.0, 0.0, 0.5, 5.0, -2.0]),
        ({"presence_penalty": 1.5}, [2.0, -2.5, 0.5, 1.5, -2.0]),
        ({"logit_bias": {"2": 1.0, 4: -0.5}}, [2.0, -1.0, 1.5, 3.0, -2.5]),
    ],
)
def test_each_penalty_alone(kwargs, expected):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    info = make_info([SamplingParams(**kwargs)], 5, prompt_ids=[[0]], output_ids=[[1, 3, 3]])
    assert apply_penalties_and_bias(logits, info)[0].tolist() == pytest.approx(expected)


def test_logit_bias_forces_and_bans():
    torch.manual_seed(2)
    logits = torch.randn(2, 64)
    top = int(logits[1].argmax())
    params = [SamplingParams(logit_bias={"17": 100.0}), SamplingParams(logit_bias={top: -100.0})]
    for i in range(200):  # a seed per draw: a seeded row's coin is fixed by (seed, output position)
        ids = sample(logits, make_info(params, 64, generators=[gen(5 + 2 * i), gen(6 + 2 * i)])).tolist()
        assert ids[0] == 17
        assert ids[1] != top
    greedy = make_info([SamplingParams(temperature=0.0, logit_bias={"17": 100.0}),
                        SamplingParams(temperature=0.0, logit_bias={top: -100.0})], 64)
    ids = sample(logits, greedy).tolist()
    assert ids[0] == 17 and ids[1] != top


def test_min_new_tokens_bans_stop_ids_until_reached():
    eos, stop = 4, 2
    logits = torch.tensor([[0.0, 1.0, 4.0, 2.0, 5.0]])  # eos best, then the stop token, then 3
    p = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[stop])
    picks = []
    for output in ([], [3], [3, 3], [3, 3, 3]):
        info = make_info([p], 5, output_ids=[output], stop_ids=[{eos, stop}])
        picks.append(sample(logits, info).item())
    assert picks == [3, 3, eos, eos]
    info = make_info([p], 5, output_ids=[[3]], stop_ids=[{eos, stop}])
    processed = apply_penalties_and_bias(logits, info)
    assert processed[0, eos] == float("-inf") and processed[0, stop] == float("-inf")
    # sampled rows too: eos never drawn before min_new_tokens
    for seed in range(300):
        info = make_info([SamplingParams(min_new_tokens=3)], 5, generators=[gen(seed)], output_ids=[[1]],
                         stop_ids=[{eos}])
        assert sample(logits, info).item() != eos


# ---------------------------------------------------------------- temperature / top-k / top-p / min-p


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, [0.4, 0.3, 0.2, 0.1]),
        ({"top_k": 2}, [4 / 7, 3 / 7, 0, 0]),
        ({"top_k": 3}, [4 / 9, 3 / 9, 2 / 9, 0]),
        ({"top_p": 0.6}, [4 / 7, 3 / 7, 0, 0]),  # mass before each: 0, .4, .7, .9 -> keep < .6
        ({"top_p": 0.75}, [4 / 9, 3 / 9, 2 / 9, 0]),
        ({"top_p": 0.3}, [1, 0, 0, 0]),
        ({"min_p": 0.3}, [4 / 9, 3 / 9, 2 / 9, 0]),  # threshold 0.12
        ({"min_p": 0.6}, [4 / 7, 3 / 7, 0, 0]),  # threshold 0.24
        # sequential: top_k=2 renormalises to [4/7, 3/7]; mass before token 1 is 4/7 >= 0.5 -> dropped
        ({"top_k": 2, "top_p": 0.5}, [1, 0, 0, 0]),
        ({"top_k": 3, "min_p": 0.6}, [4 / 7, 3 / 7, 0, 0]),
    ],
)
def test_probs_match_hand_computed(kwargs, expected):
    info = make_info([SamplingParams(**kwargs)], 4)
    probs = probs_from_logits(LOGITS4, info)
    assert probs[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert all(probs[0, i].item() == 0.0 for i, e in enumerate(expected) if e == 0)  # exactly 0


def _filter_by_full_sort(probs, top_ks, top_ps, min_ps):
    """The definition, written out: sort every row, mask top_k, then top_p, then min_p, renormalise."""
    B, V = probs.shape
    sorted_p, order = probs.sort(dim=-1, descending=True)
    sorted_p = sorted_p.masked_fill(torch.arange(V).view(1, V) >= top_ks.view(B, 1), 0.0)
    renorm = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    before = renorm.cumsum(dim=-1) - renorm
    sorted_p = sorted_p.masked_fill((before >= top_ps.view(B, 1)) & (top_ps.view(B, 1) < 1.0), 0.0)
    sorted_p = sorted_p.masked_fill(sorted_p < sorted_p[:, :1] * min_ps.view(B, 1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p / sorted_p.sum(dim=-1, keepdim=True))


def test_filters_over_top_candidates_equal_a_full_sort(monkeypatch):
    """Rows filtered over their FILTER_CANDIDATES largest probabilities (peaked rows, small top_k, min_p) and rows
    that must sort everything (flat rows with top_p near 1, top_k above the candidates) give the definition's
    probabilities; each row's result is the same alone as in the batch."""
    monkeypatch.setattr(sampler_mod, "FILTER_CANDIDATES", 16)
    torch.manual_seed(0)
    V = 200
    peaked, flat = torch.randn(V) * 4, torch.randn(V) * 0.1
    rows = [  # (logits, top_k, top_p, min_p, goes over the candidates)
        (peaked, 5, 1.0, 0.0, True),        # top_k <= candidates
        (peaked, V, 0.8, 0.0, True),        # the nucleus lies in the candidates
        (flat, V, 0.99, 0.0, False),        # a flat row's nucleus does not
        (peaked, V, 1.0, 0.3, True),        # min_p keeps few tokens
        (flat, V, 1.0, 0.5, False),         # ... or many
        (flat, 50, 0.9, 0.0, False),        # top_k above the candidates: sorted
        (peaked, 12, 0.7, 0.05, True),      # all three
        (flat, V, 1.0, 0.0, False),         # no filter: probabilities as they are
    ]
    logits = torch.stack([r[0] for r in rows])
    params = [SamplingParams(temperature=1.0, top_k=-1 if k == V else k, top_p=p, min_p=m) for _, k, p, m, _ in rows]
    info = make_info(params, V)
    probs = torch.softmax(logits, dim=-1)
    want = _filter_by_full_sort(probs, info.top_ks, info.top_ps, info.min_ps)
    got = probs_from_logits(logits, info)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    head = sampler_mod._kept_within(probs, probs.topk(16, dim=-1).values, info.top_ks, info.top_ps, info.min_ps)
    assert head.tolist()[:7] == [r[4] for r in rows][:7]  # both ways were taken
    for i in range(len(rows)):
        alone = probs_from_logits(logits[i : i + 1], make_info(params[i : i + 1], V))
        assert torch.equal(alone[0], got[i])


def test_temperature_scaling():
    info = make_info([SamplingParams(temperature=2.0), SamplingParams(temperature=0.5)], 4)
    probs = probs_from_logits(LOGITS4.expand(2, 4), info)
    p = [0.4, 0.3, 0.2, 0.1]
    hot = [math.sqrt(x) / sum(math.sqrt(y) for y in p) for x in p]
    cold = [x * x / sum(y * y for y in p) for x in p]
    assert probs[0].tolist() == pytest.approx(hot, abs=1e-6)
    assert probs[1].tolist() == pytest.approx(cold, abs=1e-6)


def test_probs_rows_are_independent_and_batched():
    # Each row gets its own filter in one batch; a top_p=1 row is untouched by its batch mates' top_p.
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(), SamplingParams(min_p=0.6)]
    info = make_info(params, 4)
    probs = probs_from_logits(LOGITS4.expand(4, 4), info)
    assert probs[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0], abs=1e-6)
    assert probs[1].tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0], abs=1e-6)
    assert probs[2].tolist() == pytest.approx([0.4, 0.3, 0.2, 0.1], abs=1e-6)
    assert probs[3].tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0], abs=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(4))


def test_filters_never_emit_masked_tokens():
    torch.manual_seed(3)
    n = 3000
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.6),
              SamplingParams(top_p=0.75)] * (n // 4)
    info = make_info(params, 4)
    ids = sample(LOGITS4.expand(len(params), 4), info).view(-1, 4)  # column j = filter j
    assert set(ids[:, 0].tolist()) == {0, 1}
    assert set(ids[:, 1].tolist()) == {0, 1}
    assert set(ids[:, 2].tolist()) == {0, 1}
    assert set(ids[:, 3].tolist()) == {0, 1, 2}


def test_empirical_frequencies_within_6_sigma():
    torch.manual_seed(4)
    n = 20_000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    info = make_info([SamplingParams()] * n, 4)
    ids = sample(p.log().expand(n, 4), info)
    counts = torch.bincount(ids, minlength=4).tolist()
    for count, prob in zip(counts, p.tolist(), strict=True):
        sigma = math.sqrt(n * prob * (1 - prob))
        assert abs(count - n * prob) < 6 * sigma, (counts, p.tolist())


# ---------------------------------------------------------------- seeded sampling


def _draw_sequence(logits_for_row, seed, batch_position, mates):
    """Samples 30 steps for one seeded row placed among `mates` (list of (params, generator, logits)); every row
    appends its token to its output, as the scheduler does."""
    g = gen(seed)
    out = []
    mate_outputs = [[] for _ in mates]
    for step in range(30):
        rows = list(mates)
        rows.insert(batch_position, (SamplingParams(temperature=0.9, top_p=0.95), g, logits_for_row[step]))
        outputs = list(mate_outputs)
        outputs.insert(batch_position, out)
        info = make_info([r[0] for r in rows], logits_for_row.shape[-1], generators=[r[1] for r in rows],
                         output_ids=[list(o) for o in outputs])
        ids = sample(torch.stack([r[2] for r in rows]), info).tolist()
        for o, tok in zip(outputs, ids, strict=True):
            o.append(tok)
    return out


def test_seeded_sampling_independent_of_batch():
    torch.manual_seed(5)
    V = 50
    row_logits = torch.randn(30, V) * 0.5  # one row's logits per step
    alone = _draw_sequence(row_logits, 1234, 0, [])
    mates = [
        (SamplingParams(temperature=1.0), gen(7), torch.randn(V)),
        (SamplingParams(temperature=0.0), None, torch.randn(V)),
        (SamplingParams(temperature=1.3, top_k=5), None, torch.randn(V)),  # global RNG
    ]
    in_batch = _draw_sequence(row_logits, 1234, 2, mates)
    assert alone == in_batch
    in_batch_first = _draw_sequence(row_logits, 1234, 0, mates[::-1])
    assert alone == in_batch_first
    assert _draw_sequence(row_logits, 1235, 0, []) != alone
    assert _draw_sequence(row_logits, 1234, 0, []) == alone  # reproducible


def test_sample_inverse_cdf_by_hand():
    # cumulative in token-id order: .5, .75, .875, 1 (exact in binary); boundaries are inclusive
    p = torch.tensor([0.5, 0.25, 0.125, 0.125]).expand(8, 4)
    u = torch.tensor([1e-9, 0.5, 0.51, 0.75, 0.76, 0.875, 0.88, 1.0], dtype=torch.float64)
    assert sample_inverse_cdf(p, u).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # zero weights are never chosen; unnormalised weights work the same: [0, 2, 0, 2] -> cumulative .5, 1.0
    w = torch.tensor([[0.0, 2.0, 0.0, 2.0]]).expand(3, 4)
    assert sample_inverse_cdf(w, torch.tensor([1e-9, 0.5, 0.51])).tolist() == [1, 1, 3]


def test_seeded_row_samples_the_race_of_its_output_position():
    # the race winner argmax p / E with E the hash of (seed, position, token), written out from the hash reference
    p = torch.softmax(LOGITS4, dim=-1).view(-1).tolist()
    for seed in range(5):
        for t in (0, 1, 7):
            info = make_info([SamplingParams()], 4, generators=[gen(seed)], output_ids=[[2] * t])
            expo = [reference_exponential(position_key(seed, t), x) for x in range(4)]
            assert sample(LOGITS4, info).item() == max(range(4), key=lambda x: p[x] / expo[x])


def test_seeded_rows_follow_the_distribution():
    # one row per seed (20000 seeds): the position-keyed races give the target frequencies
    n = 20_000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    info = make_info([SamplingParams()] * n, 4, generators=[gen(s) for s in range(n)], output_ids=[[0]] * n)
    counts = torch.bincount(sample(p.log().expand(n, 4), info), minlength=4).tolist()
    for count, prob in zip(counts, p.tolist(), strict=True):
        assert abs(count - n * prob) < 6 * math.sqrt(n * prob * (1 - prob)), (counts, p.tolist())


# ---------------------------------------------------------------- logprobs


def test_compute_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(3, 10) * 2
    chosen_ids = torch.tensor([4, 0, 9])
    chosen, tops, probes = compute_logprobs(logits, chosen_ids, [0, 2, 10])
    assert probes == [None, None, None]
    ref = torch.log_softmax(logits, dim=-1)
    assert chosen.shape == (3,)
    assert torch.allclose(chosen, ref[torch.arange(3), chosen_ids])
    assert tops[0] == []
    assert len(tops[1]) == 2 and len(tops[2]) == 10
    for row, top in ((1, tops[1]), (2, tops[2])):
        order = ref[row].argsort(descending=True).tolist()
        assert [t for _, t in top] == order[: len(top)]
        assert [lp for lp, _ in top] == pytest.approx([ref[row, t].item() for t in order[: len(top)]])
        assert all(a[0] >= b[0] for a, b in zip(top, top[1:], strict=False))
    chosen, tops, _ = compute_logprobs(logits, chosen_ids, [0, 0, 0])
    assert tops == [[], [], []]


def test_compute_logprobs_probes_and_temperature():
    """token_ids_logprob rows report the asked ids in the asked order; temp_scaled rows use logits / T."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    chosen, tops, probes = compute_logprobs(logits, torch.tensor([3, 0]), [1, 0], [[2, 0], None], [0.5, 1.0])
    scaled = torch.log_softmax(logits[0] / 0.5, dim=-1)
    raw = torch.log_softmax(logits[1], dim=-1)
    assert chosen.tolist() == pytest.approx([scaled[3].item(), raw[0].item()])
    assert tops[0] == [(pytest.approx(scaled[3].item()), 3)] and tops[1] == []
    assert probes[0] == [(pytest.approx(scaled[2].item()), 2), (pytest.approx(scaled[0].item()), 0)]
    assert probes[1] is None


@pytest.mark.parametrize("kwargs, plain", [
    ({"temperature": 0.7}, True),
    ({"temperature": 0.7, "top_k": 100}, True),  # top_k at the vocabulary's size or above cuts nothing
    ({"temperature": 0.7, "top_k": 99}, False),
    ({"temperature": 0.7, "top_p": 0.95}, False),
    ({"temperature": 0.7, "min_p": 0.05}, False),
    ({"temperature": 0.7, "repetition_penalty": 1.1}, False),
    ({"temperature": 0.7, "frequency_penalty": 0.5}, False),
    ({"temperature": 0.7, "presence_penalty": 0.5}, False),
    ({"temperature": 0.7, "logit_bias": {"3": 1.0}}, False),
    ({"temperature": 0.7, "min_new_tokens": 5}, False),  # 4 output tokens so far: the stop ids are still banned
    ({"temperature": 0.7, "min_new_tokens": 4}, True),
    ({"temperature": 0.0}, False),  # greedy
])
def test_is_plain_sampled_by_hand(kwargs, plain):
    """The rows whose distribution is softmax(logits / temperature) alone (vocabulary 100, 4 tokens generated)."""
    assert is_plain_sampled(SamplingParams(**kwargs), num_output=4, vocab_size=100) is plain
