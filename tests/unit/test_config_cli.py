"""ServerArgs validation and the command line generated from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specserve.args import add_server_args, server_args_from
from specserve.cli import main
from specserve.config import ConfigError, ServerArgs, flag_name
from specserve.demo_models import demo_path
from specserve.speculative import eagle3
from specserve.speculative.eagle3 import DEMO_EAGLE3_TREE, SMOLLM2_EAGLE3_ONE_PASS_TREE, SMOLLM2_EAGLE3_TREE
from specserve.speculative.tree import max_tree_nodes


def parse(argv: list[str]) -> ServerArgs:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return server_args_from(p.parse_args(argv))


def test_every_field_is_a_flag_with_help():
    p = argparse.ArgumentParser()
    add_server_args(p)
    text = p.format_help()
    for f in dataclasses.fields(ServerArgs):
        assert flag_name(f.name) in text
        assert f.metadata.get("help"), f.name


def test_sglang_aliases_and_types():
    args = parse(["--model", "m", "--mem-fraction", "0.6", "--max-total-tokens", "100", "--disable-radix-cache",
                  "--dtype", "bf16", "--speculative-draft-model", "d", "--speculative-draft-dtype", "half"])
    assert args.model_path == "m" and args.mem_fraction_static == 0.6 and args.max_total_tokens == 100
    assert args.disable_radix_cache is True and args.dtype == "bfloat16"
    assert args.speculative_draft_dtype == "float16" and parse([]).speculative_draft_dtype == "auto"
    assert args.speculative_draft_model_path == "d"


@pytest.mark.parametrize("argv,flag", [
    (["--dtype", "int3"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--schedule-policy", "random"], "--schedule-policy"),
    (["--mem-fraction-static", "1.2"], "--mem-fraction-static"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--port", "70000"], "--port"),
    (["--log-level", "loud"], "--log-level"),
    (["--tool-call-parser", "qwen9"], "--tool-call-parser"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
    (["--enable-torch-compile", "--torch-compile-max-bs", "0"], "--torch-compile-max-bs"),
    (["--disable-torch-compile", "--torch-compile-in-background"], "--disable-torch-compile"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=f"^{flag}"):
        parse(argv)


SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d"]


@pytest.mark.parametrize("argv,flag", [
    (SPEC + ["--speculative-num-steps", "3"], "--speculative-eagle-topk"),
    (SPEC + ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
     "--speculative-num-draft-tokens"),  # 2 steps of topk 2 draft 2 + 4 candidates: at most 7 nodes
    (SPEC + ["--speculative-num-steps", "0", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "2"],
     "--speculative-num-steps"),
    (SPEC + ["--speculative-accept-threshold-single", "1.5"], "--speculative-accept-threshold-single"),
    (SPEC + ["--speculative-draft-stop-threshold", "1.0"], "--speculative-draft-stop-threshold"),
    (SPEC + ["--speculative-draft-stop-threshold", "-0.1"], "--speculative-draft-stop-threshold"),
    (SPEC + ["--speculative-draft-score-temperature", "0"], "--speculative-draft-score-temperature"),
    (SPEC + ["--speculative-draft-score-temperature", "-1"], "--speculative-draft-score-temperature"),
    (SPEC + ["--speculative-draft-score-temperature", "nan"], "--speculative-draft-score-temperature"),
    (SPEC + ["--speculative-draft-score-temperature", "11"], "--speculative-draft-score-temperature"),
    (SPEC + ["--speculative-draft-dtype", "int8"], "--speculative-draft-dtype"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-draft-model-path"),
    (["--speculative-algorithm", "STANDALONE"], "--speculative-draft-model-path"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-branch-length", "1"],
     "--speculative-ngram-branch-length"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "4"], "--speculative-ngram-max-match-window-size"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-match-window-size", "18"],
     "--speculative-ngram-max-match-window-size"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-bfs-breadth", "4",
      "--speculative-ngram-max-bfs-breadth", "3"], "--speculative-ngram-min-bfs-breadth"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-match-type", "DFS"], "--speculative-ngram-match-type"),
])
def test_bad_speculative_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=f"^{flag}"):
        parse(argv)


def test_speculative_tree_shape_rules():
    # NEXTN is EAGLE; topk 1 forces N = S + 1
    args = parse(SPEC[:1] + ["NEXTN"] + SPEC[2:] + ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                                   "--speculative-num-draft-tokens", "8"])
    assert args.speculative_algorithm == "EAGLE" and args.speculative_num_draft_tokens == 4
    # none given: chosen from the target's architecture
    llama, other = parse(SPEC), parse(SPEC)
    llama.resolve_speculative_defaults("LlamaForCausalLM")
    other.resolve_speculative_defaults("Qwen2ForCausalLM")
    assert (llama.speculative_num_steps, llama.speculative_eagle_topk, llama.speculative_num_draft_tokens) == (5, 4, 8)
    assert (other.speculative_num_steps, other.speculative_eagle_topk, other.speculative_num_draft_tokens) == (3, 1, 4)
    # NGRAM: N defaults to the max match window
    assert parse(["--speculative-algorithm", "NGRAM"]).speculative_num_draft_tokens == 12


def test_the_bundled_eagle3_heads_get_their_tuned_default_trees(tmp_path):
    """demo-eagle3 / smollm2-eagle3 (by name or folder) without tree flags: their tuned trees; explicit flags,
    another head, EAGLE-2 on that head's name, or the overlap scheduler keep their own rules."""
    demo = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path"]

    def tree(argv, architecture="LlamaForCausalLM"):
        args = parse(argv)
        args.resolve_speculative_defaults(architecture)
        return args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens

    assert DEMO_EAGLE3_TREE == (8, 3, 12)
    assert tree(demo + ["demo-eagle3"]) == DEMO_EAGLE3_TREE
    assert tree(demo + [demo_path("demo-eagle3")]) == DEMO_EAGLE3_TREE
    smollm2 = SMOLLM2_EAGLE3_ONE_PASS_TREE if eagle3.verify_on_vector_loop(parse(demo + ["x"])) else SMOLLM2_EAGLE3_TREE
    assert tree(demo + ["smollm2-eagle3"]) == tree(demo + [demo_path("smollm2-eagle3")]) == smollm2
    assert tree(demo + [str(tmp_path)]) == (5, 4, 8)  # another EAGLE-3 head
    assert tree(demo + ["demo-eagle3", "--speculative-num-steps", "6", "--speculative-eagle-topk", "4",
                        "--speculative-num-draft-tokens", "16"]) == (6, 4, 16)
    assert tree(demo + ["demo-eagle3", "--enable-spec-v2"]) == (3, 1, 4)
    assert tree(demo + ["demo-eagle3"], "Qwen2ForCausalLM") == (3, 1, 4)


def test_tree_bound_counts_every_drafted_candidate():
    """N - 1 may be any number up to the candidates S levels of topk K draft: K, then K children of K branches."""
    assert [max_tree_nodes(s, k) for s, k in [(1, 1), (3, 1), (1, 4), (2, 2), (3, 4), (5, 8)]] == [2, 4, 5, 7, 37, 265]
    for steps, topk, tokens in [("3", "4", "16"), ("5", "8", "64"), ("2", "2", "7")]:  # the seed page's, the edge
        args = parse(SPEC + ["--speculative-num-steps", steps, "--speculative-eagle-topk", topk,
                                  "--speculative-num-draft-tokens", tokens])
        assert args.speculative_num_draft_tokens == int(tokens)


def test_speculative_defaults_max_running_requests():
    assert ServerArgs().effective_max_running_requests == 256
    assert dataclasses.replace(ServerArgs(), speculative_algorithm="EAGLE").effective_max_running_requests == 48


def test_generate_command_reports_bad_flag(capsys, model_factory):
    assert main(["generate", "hi", "--model-path", model_factory("llama"), "--schedule-policy", "x"]) == 2
    assert "--schedule-policy" in capsys.readouterr().err


def test_generate_command_runs(capsys, model_factory):
    assert main(["generate", "def f(x):", "--model-path", model_factory("llama"), "--max-new-tokens", "5",
                 "--max-total-tokens", "256"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def f(x):")
    assert "5 tokens" in captured.err


def test_mixed_chunk_flag_and_speculation(caplog):
    assert parse(["--enable-mixed-chunk"]).enable_mixed_chunk is True
    with caplog.at_level("WARNING"):
        args = parse(SPEC + ["--enable-mixed-chunk"])
    assert args.enable_mixed_chunk is False  # as in SGLang: speculative steps take no prefill chunk
    assert "--enable-mixed-chunk" in caplog.text


def test_sglang_launch_flags_of_its_own_tests(monkeypatch, caplog):
    """Flags SGLang's docs and test launchers pass: abbreviations of --mem-fraction-static, the CUDA-graph batch list,
    GPU attention backends and page sizes (mapped, with a warning), the overlap switch, the warm-up switch."""
    base = ["--model-path", "m"]
    assert parse(base + ["--mem-fraction", "0.6"]).mem_fraction_static == 0.6  # the docs page's spelling
    assert parse(base + ["--mem-frac", "0.7"]).mem_fraction_static == 0.7  # SGLang's MTP test's
    assert parse(base + ["--cuda-graph-bs", "1", "2", "8"]).effective_cuda_graph_max_bs == 8
    assert parse(base + ["--cuda-graph-bs", "1", "2", "--cuda-graph-max-bs", "4"]).effective_cuda_graph_max_bs == 4
    with caplog.at_level("WARNING", logger="specserve.config"):
        args = parse(base + ["--attention-backend", "triton", "--page-size", "64", "--skip-server-warmup"])
    assert args.attention_backend == "triton" and args.page_size == 64 and args.skip_server_warmup
    assert "--attention-backend triton" in caplog.text and "--page-size 64" in caplog.text
    assert parse(base + ["--attention-backend", "torch_native"]).attention_backend == "torch_native"
    for argv, flag in [(["--attention-backend", "cuda-magic"], "--attention-backend"), (["--page-size", "0"],
                       "--page-size"), (["--cuda-graph-bs", "0"], "--cuda-graph-bs")]:
        with pytest.raises(ConfigError, match=flag):
            parse(base + argv)
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "True")
    spec = base + SPEC[2:] + ["--speculative-algorithm", "STANDALONE"]
    assert parse(spec).enable_spec_v2
    assert not parse(spec + ["--disable-overlap-schedule"]).enable_spec_v2


def test_smollm2s_tree_takes_one_kernel_pass_where_the_vector_loop_verifies(monkeypatch):
    """smollm2-eagle3's default tree has 6 nodes (one pass of the few-row kernel's vector loop) where a CPU bf16
    verify runs on that loop, else 8 (the tile unit takes 8 rows at one row's cost); the demo head's tree does not
    move; the rule reads --device, --dtype and the kernel's availability."""
    from specserve.platform.cpu import small_gemm

    args = parse(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "smollm2-eagle3"])
    for loop, want in ((True, SMOLLM2_EAGLE3_ONE_PASS_TREE), (False, SMOLLM2_EAGLE3_TREE)):
        monkeypatch.setattr(eagle3, "verify_on_vector_loop", lambda a, loop=loop: loop)
        assert eagle3.bundled_tree("smollm2-eagle3", args) == want
        assert eagle3.bundled_tree("demo-eagle3", args) == DEMO_EAGLE3_TREE
    monkeypatch.undo()
    monkeypatch.setattr(small_gemm, "available", lambda: True)
    monkeypatch.setattr(small_gemm, "amx_runs", lambda: False)
    assert eagle3.verify_on_vector_loop(args.replace(device="cpu", dtype="bfloat16"))
    assert eagle3.verify_on_vector_loop(args.replace(device="cpu", dtype="auto"))
    assert not eagle3.verify_on_vector_loop(args.replace(device="cuda"))
    assert not eagle3.verify_on_vector_loop(args.replace(device="cpu", dtype="float32"))
    monkeypatch.setattr(small_gemm, "amx_runs", lambda: True)
    assert not eagle3.verify_on_vector_loop(args.replace(device="cpu"))
    monkeypatch.setattr(small_gemm, "amx_runs", lambda: False)
    monkeypatch.setattr(small_gemm, "available", lambda: False)
    assert not eagle3.verify_on_vector_loop(args.replace(device="cpu"))
