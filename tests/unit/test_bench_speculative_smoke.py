"""`specserve bench-speculative`: the grid helpers on hand-checked inputs, and the command end to end on a tiny
Llama target with a tiny EAGLE head (JSONL fields, skipped points, baseline and best rows, files)."""

from __future__ import annotations

import json
import os

import pytest

from specserve.bench import bench_speculative as bs
from specserve.bench.report import read_jsonl
from specserve.config import ConfigError, ServerArgs
from specserve.test.tiny import make_eagle_head_dir


def test_parse_int_list():
    assert bs.parse_int_list("1,4,16", "--batch-size") == [1, 4, 16]
    assert bs.parse_int_list("3, 1,3", "--steps") == [3, 1]
    for bad in ("1,x", "0,2", ""):
        with pytest.raises(ConfigError, match="--steps"):
            bs.parse_int_list(bad, "--steps")


def test_expand_grid_skips_invalid_and_normalized_duplicates():
    base = ServerArgs(speculative_algorithm="EAGLE").validate()
    configs, skipped = bs.expand_grid(base, [1, 2], [1, 2], [2, 4])
    # topk 1 forces draft = steps + 1; topk 2 holds at most steps * 2 + 1 drafts
    assert [(c.steps, c.topk, c.num_draft_tokens) for c, _ in configs] == [(1, 1, 2), (1, 2, 2), (2, 1, 3),
                                                                           (2, 2, 2), (2, 2, 4)]
    assert [(s["steps"], s["topk"], s["num_draft_tokens"]) for s in skipped] == [(1, 1, 4), (1, 2, 4), (2, 1, 4)]
    assert "makes it steps 1 topk 1 draft 2, already measured (from steps 1 topk 1 draft 2)" in skipped[0]["reason"]
    assert "--speculative-num-draft-tokens 4 exceeds" in skipped[1]["reason"]
    assert all(a.speculative_num_draft_tokens == c.num_draft_tokens for c, a in configs)


def test_parse_float_list():
    assert bs.parse_float_list(None, "--score-temperature", lambda v: v > 0, "(0, 10]") == [None]
    assert bs.parse_float_list("1, 0.6,1", "--score-temperature", lambda v: v > 0, "(0, 10]") == [1.0, 0.6]
    for bad in ("0.5,x", "0,1", ""):
        with pytest.raises(ConfigError, match="--score-temperature"):
            bs.parse_float_list(bad, "--score-temperature", lambda v: 0 < v <= 10, "(0, 10]")


def test_expand_grid_sweeps_threshold_and_temperature():
    base = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_stop_threshold=0.1,
                      speculative_draft_score_temperature=0.8).validate()
    configs, skipped = bs.expand_grid(base, [2], [2], [4], [None, 0.05], [1.0, 0.5, 20.0])
    assert [c.label for c, _ in configs] == [
        "steps 2 topk 2 draft 4 T 1", "steps 2 topk 2 draft 4 T 0.5",
        "steps 2 topk 2 draft 4 thr 0.05 T 1", "steps 2 topk 2 draft 4 thr 0.05 T 0.5"]
    # None keeps the server flag's value (threshold 0.1); the swept values replace it
    assert [(a.speculative_draft_stop_threshold, a.speculative_draft_score_temperature) for _, a in configs] == [
        (0.1, 1.0), (0.1, 0.5), (0.05, 1.0), (0.05, 0.5)]
    assert [(s["stop_threshold"], s["score_temperature"]) for s in skipped] == [(None, 20.0), (0.05, 20.0)]
    assert all("--speculative-draft-score-temperature must be in" in s["reason"] for s in skipped)


def test_parse_on_off_list_and_the_coupling_axis():
    assert bs.parse_on_off_list(None, "--coupled-drafting") == [None]
    assert bs.parse_on_off_list("on, off,on", "--coupled-drafting") == [True, False]
    for bad in ("on,maybe", "", "1"):
        with pytest.raises(ConfigError, match="--coupled-drafting"):
            bs.parse_on_off_list(bad, "--coupled-drafting")
    base = ServerArgs(speculative_algorithm="EAGLE").validate()
    configs, _ = bs.expand_grid(base, [2], [2], [4], coupled=[True, False])
    assert [c.label for c, _ in configs] == ["steps 2 topk 2 draft 4 coupled", "steps 2 topk 2 draft 4 uncoupled"]
    assert [a.disable_speculative_coupled_drafting for _, a in configs] == [False, True]


def test_the_draft_dtype_axis():
    assert bs.parse_dtype_list(None) == [None]
    assert bs.parse_dtype_list("float32, bfloat16,float32") == ["float32", "bfloat16"]
    for bad in ("float32,int8", "", "fp8"):
        with pytest.raises(ConfigError, match="--draft-dtype"):
            bs.parse_dtype_list(bad)
    base = ServerArgs(speculative_algorithm="EAGLE").validate()
    configs, _ = bs.expand_grid(base, [2], [2], [4], dtypes=["float32", "bf16"])
    assert [c.label for c, _ in configs] == ["steps 2 topk 2 draft 4 float32", "steps 2 topk 2 draft 4 bf16"]
    assert [a.speculative_draft_dtype for _, a in configs] == ["float32", "bfloat16"]  # validated: bf16's long name


def test_expand_grid_ngram_ignores_threshold_and_temperature():
    base = ServerArgs(speculative_algorithm="NGRAM").validate()
    configs, skipped = bs.expand_grid(base, [1], [1], [4], [None], [1.0, 0.5])
    assert [c.label for c, _ in configs] == ["draft 4"]
    assert len(skipped) == 1 and "already measured (from steps 1 topk 1 draft 4 T 1)" in skipped[0]["reason"]


def test_expand_grid_ngram_keeps_only_draft_tokens():
    base = ServerArgs(speculative_algorithm="NGRAM").validate()
    configs, skipped = bs.expand_grid(base, [1, 3], [1], [4, 8])
    assert [c.label for c, _ in configs] == ["draft 4", "draft 8"]
    assert len(skipped) == 2 and all("already measured" in s["reason"] for s in skipped)


def test_prompts_for_batch_cycles_to_a_multiple_of_the_batch():
    pool = ["a", "b", "c"]
    assert bs.prompts_for_batch(pool, 1, 2) == ["a", "b"]
    assert bs.prompts_for_batch(pool, 2, 3) == ["a", "b", "c", "a"]
    assert bs.prompts_for_batch(pool, 4, 2) == ["a", "b", "c", "a"]


def test_add_speedups_and_best():
    rows = [{"config": "baseline", "batch_size": 1, "tokens_per_s": 100.0},
            {"config": "steps 3 topk 1 draft 4", "batch_size": 1, "tokens_per_s": 150.0, "accept_length": 2.5},
            {"config": "baseline", "batch_size": 8, "tokens_per_s": 400.0},
            {"config": "steps 3 topk 1 draft 4", "batch_size": 8, "tokens_per_s": 300.0, "accept_length": 2.5}]
    out = bs.add_speedups(rows)
    assert [r["speedup"] for r in out] == [1.0, 1.5, 1.0, 0.75]
    assert [r["best"] for r in out] == [False, True, True, False]
    lines = bs.best_lines(out)
    assert lines[0].startswith("batch 1: best = steps 3 topk 1 draft 4") and "1.50x" in lines[0]
    assert lines[1].startswith("batch 8: best = baseline") and "no speculative configuration" in lines[1]


def test_slowest_steps_per_generate_call_by_hand():
    def meta(verify: int, plain: int = 0) -> dict:
        return {"spec_verify_ct": verify, "spec_plain_tokens": plain}

    # calls of 2: [10, 12] -> 12 / 11; [14, 16 + 4 plain] -> 20 / 17; the median of the two
    metas = [meta(10), meta(12), meta(14), meta(16, 4)]
    assert bs.slowest_steps(metas, 2) == pytest.approx((12 / 11 + 20 / 17) / 2)
    assert bs.slowest_steps(metas + [meta(9)], 2) == pytest.approx(12 / 11)  # a last, shorter call: 9 / 9
    assert bs.slowest_steps([{"completion_tokens": 8}] * 2, 2) is None  # nothing speculated


def test_simulate_acc_len_recorded_from_either_name(monkeypatch):
    for name in bs.SIMULATE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert bs.simulate_acc_len() is None
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "2.5")
    assert bs.simulate_acc_len() == "2.5"
    monkeypatch.setenv("SPECSERVE_SIMULATE_ACC_LEN", "3")
    assert bs.simulate_acc_len() == "3"


@pytest.fixture
def eagle_pair(model_factory, tmp_path, monkeypatch):
    """(target, self EAGLE head, the sweep flags naming them) on a tiny Llama, the simulation variables unset."""
    for name in bs.SIMULATE_ENV:
        monkeypatch.delenv(name, raising=False)
    target = model_factory("llama", num_hidden_layers=1, unit_embeddings=True)
    head = make_eagle_head_dir(str(tmp_path / "eagle"), target, kind="self")
    flags = ["--model-path", target, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", head,
             "--max-new-tokens", "8", "--num-prompts", "2", "--num-threads", "2", "--no-progress"]
    return target, head, flags


def test_bench_speculative_end_to_end(eagle_pair, tmp_path, capsys):
    _, head, flags = eagle_pair
    out = tmp_path / "out"
    rc = bs.main(flags + ["--batch-size", "1,2", "--steps", "1,2", "--topk", "1,2", "--num-draft-tokens", "2,4",
                          "--out-dir", str(out)])
    assert rc == 0
    rows = read_jsonl(str(out / "results.jsonl"))
    configs = ["baseline", "steps 1 topk 1 draft 2", "steps 1 topk 2 draft 2", "steps 2 topk 1 draft 3",
               "steps 2 topk 2 draft 2", "steps 2 topk 2 draft 4"]
    assert [(r["config"], r["batch_size"]) for r in rows] == [(c, b) for b in (1, 2) for c in configs]
    for r in rows:
        assert r["completion_tokens"] == 8 * r["num_prompts"] and r["num_prompts"] == 2  # ignore_eos
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["decode_steps"] > 0
        assert r["simulate_acc_len"] is None
        if r["config"] == "baseline":
            assert r["speedup"] == 1.0 and r["accept_length"] is None and r["verify_ms"] is None
            assert r["slowest_steps"] is None
            assert r["algorithm"] is None and r["draft_model_path"] is None
        else:
            assert r["algorithm"] == "EAGLE" and r["draft_model_path"] == head
            assert r["accept_length"] >= 1.0 and r["verify_steps"] > 0 and r["draft_ms"] > 0
            assert r["slowest_steps"] >= 1.0
            if r["steps"] > 1:  # one level drafted here at most (steps 2), none where the draft stopped first
                assert 0 <= r["draft_forwards_per_tree"] <= 1
            else:
                assert r["draft_forwards_per_tree"] is None
    for b in (1, 2):
        best = [r for r in rows if r["batch_size"] == b and r["best"]]
        assert len(best) == 1 and best[0]["tokens_per_s"] == max(r["tokens_per_s"] for r in rows
                                                                 if r["batch_size"] == b)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["skipped"]) == 3 and summary["best"]["1"] in configs
    for name in ("results.md", "tokens_per_s.png", "speedup.png"):
        assert os.path.getsize(out / name) > 0
    printed = capsys.readouterr()
    assert "batch 1: best = " in printed.out and "batch 2: best = " in printed.out
    assert "skip steps 1 topk 2 draft 4" in printed.err


def test_a_sweep_frees_each_engine_before_loading_the_next(eagle_pair, monkeypatch):
    """A step clock's wrappers put the engine in reference cycles; without the collector each configuration's KV
    pool would stay until a full collection (a real model's sweep ran out of memory)."""
    import gc
    import weakref

    target, _, _ = eagle_pair
    schedulers = []
    real_load = bs.load_engine

    def load(*a, **kw):
        engine, clock = real_load(*a, **kw)
        schedulers.append(weakref.ref(engine.scheduler))
        return engine, clock

    monkeypatch.setattr(bs, "load_engine", load)
    gc.disable()  # only the sweep's own collection may free them
    try:
        for _ in range(2):
            bs.run_config(bs.BASELINE, ServerArgs(model_path=target, num_threads=1), {1: ["hi"]},
                          {"max_new_tokens": 2, "temperature": 0}, reps=1)
    finally:
        gc.enable()
    assert len(schedulers) == 2 and all(ref() is None for ref in schedulers)


def sweep_one_tree(eagle_pair, tmp_path, flags: list[str]) -> list[dict]:
    """bench-speculative at batch 1 over the tree 2/2/4 with extra flags -> its result rows (each 16 tokens, every
    speculative row accepting)."""
    out = tmp_path / "out"
    rc = bs.main(eagle_pair[2] + ["--batch-size", "1", "--steps", "2", "--topk", "2", "--num-draft-tokens", "4",
                                  *flags, "--out-dir", str(out)])
    assert rc == 0
    rows = read_jsonl(str(out / "results.jsonl"))
    assert all(r["completion_tokens"] == 16 for r in rows)
    assert all(r["accept_length"] >= 1.0 for r in rows[1:])
    return rows


def test_bench_speculative_sweeps_score_temperature(eagle_pair, tmp_path):
    rows = sweep_one_tree(eagle_pair, tmp_path, ["--stop-threshold", "0.02", "--score-temperature", "1,0.5"])
    assert [(r["config"], r["stop_threshold"], r["score_temperature"]) for r in rows] == [
        ("baseline", None, None), ("steps 2 topk 2 draft 4 thr 0.02 T 1", 0.02, 1.0),
        ("steps 2 topk 2 draft 4 thr 0.02 T 0.5", 0.02, 0.5)]


def test_bench_speculative_sampled_with_and_without_coupled_drafting(eagle_pair, tmp_path):
    rows = sweep_one_tree(eagle_pair, tmp_path, ["--temperature", "0.7", "--coupled-drafting", "on,off"])
    assert [(r["config"], r["coupled_drafting"]) for r in rows] == [
        ("baseline", None), ("steps 2 topk 2 draft 4 coupled", True), ("steps 2 topk 2 draft 4 uncoupled", False)]


def test_run_interleaved_alternates_configurations_batch_by_batch(monkeypatch):
    calls, shut = [], []

    class FakeEngine:
        def __init__(self, name):
            self.name = name

        def shutdown(self):
            shut.append(self.name)

    def load(args, params, batch_aware):
        if args == "bad":
            raise ConfigError("draft vocabulary mismatch")
        return FakeEngine(args), None

    def generate(engine, prompts, params):
        calls.append((engine.name, "".join(prompts)))
        return len(prompts) * 0.5, [{"n": len(prompts)}] * len(prompts)

    monkeypatch.setattr(bs, "load_engine", load)
    monkeypatch.setattr(bs, "flush", lambda engine: calls.append((engine.name, "flush")))
    monkeypatch.setattr(bs, "start_batch", lambda engine, clock: engine.name)
    monkeypatch.setattr(bs, "timed_generate", generate)
    monkeypatch.setattr(bs, "summarize", lambda engine, clock, mark, passes, b: {"mark": mark, "passes": passes})
    monkeypatch.setattr(bs, "row_head", lambda shape, args, b, prompts: {"config": args, "batch_size": b})
    todo = [(bs.BASELINE, "A"), (bs.TreeShape(2, 1, 3), "bad"), (bs.TreeShape(3, 1, 4), "B")]
    rows, skipped = bs.run_interleaved(todo, {1: ["p", "q"], 2: ["p", "q"]}, {}, reps=2)
    rep_b1 = [("A", "flush"), ("B", "flush"), ("A", "p"), ("B", "p"), ("A", "q"), ("B", "q")]
    rep_b2 = [("A", "flush"), ("B", "flush"), ("A", "pq"), ("B", "pq")]
    assert calls == rep_b1 * 2 + rep_b2 * 2
    one = [{"n": 1}] * 2  # batch 1: two calls of one request; batch 2: one call of two
    assert rows == [{"config": "A", "batch_size": 1, "mark": "A", "passes": [(1.0, one), (1.0, one)]},
                    {"config": "B", "batch_size": 1, "mark": "B", "passes": [(1.0, one), (1.0, one)]},
                    {"config": "A", "batch_size": 2, "mark": "A", "passes": [(1.0, [{"n": 2}] * 2)] * 2},
                    {"config": "B", "batch_size": 2, "mark": "B", "passes": [(1.0, [{"n": 2}] * 2)] * 2}]
    assert skipped == [{"steps": 2, "topk": 1, "num_draft_tokens": 3, "stop_threshold": None,
                        "score_temperature": None, "coupled": None, "draft_dtype": None,
                        "reason": "draft vocabulary mismatch"}]
    assert shut == ["A", "B"]


def test_bench_speculative_interleaved_matches_sequential(eagle_pair, tmp_path):
    """Interleaving changes only when each pass runs: the greedy acceptance figures of every row are the same."""
    common = eagle_pair[2] + ["--batch-size", "1,2", "--steps", "2", "--topk", "1,2", "--num-draft-tokens", "3",
                              "--reps", "2"]
    runs = {}
    for mode in ("sequential", "interleave"):
        out = tmp_path / mode
        assert bs.main(common + ["--out-dir", str(out)] + (["--interleave"] if mode == "interleave" else [])) == 0
        runs[mode] = read_jsonl(str(out / "results.jsonl"))
    keys = ("config", "batch_size", "completion_tokens", "verify_steps", "accept_length", "decode_steps",
            "draft_forwards_per_tree")
    assert [[r[k] for k in keys] for r in runs["interleave"]] == [[r[k] for k in keys] for r in runs["sequential"]]
    assert [r["config"] for r in runs["interleave"]] == ["baseline", "steps 2 topk 1 draft 3",
                                                         "steps 2 topk 2 draft 3"] * 2
    assert all(r["accept_length"] > 1.0 for r in runs["interleave"] if r["config"] != "baseline")  # it drafted
    assert {r["interleave"] for r in runs["interleave"]} == {True}
    assert {r["interleave"] for r in runs["sequential"]} == {False}


def test_bench_speculative_bad_flags(capsys):
    assert bs.main(["--no-such-flag"]) == 2
    assert "--no-such-flag" in capsys.readouterr().err
    assert bs.main(["--batch-size", "1,zero"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    assert bs.main(["--model-path", "demo", "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err
    assert bs.main(["--score-temperature", "1,0"]) == 2
    assert "--score-temperature takes comma-separated numbers in (0, 10]" in capsys.readouterr().err
    assert bs.main(["--stop-threshold", "1"]) == 2
    assert "--stop-threshold takes comma-separated numbers in [0, 1)" in capsys.readouterr().err
