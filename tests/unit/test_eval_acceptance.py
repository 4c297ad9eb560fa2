"""`specserve eval-acceptance`: prompt files, the table, and end-to-end runs on tiny models (EAGLE with a head that
mirrors its one-layer target, so drafts are accepted; NGRAM sampled from a JSONL file)."""

from __future__ import annotations

import json

import pytest

from specserve.bench.eval_acceptance import (
    RunResult,
    format_table,
    load_prompts,
    plain_args,
    read_prompt_file,
    summarize,
)
from specserve.cli import main as cli_main
from specserve.config import ServerArgs


def test_read_prompt_file_text_and_jsonl(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("def f(x):\n\n  indented prompt\nlast")
    assert read_prompt_file(str(txt)) == ["def f(x):", "  indented prompt", "last"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a\\nb"}\n\n{"text": "c", "id": 3}\n')
    assert read_prompt_file(str(jl)) == ["a\nb", "c"]
    assert load_prompts(str(jl), num_prompts=1) == ["a\nb"]
    jl.write_text('{"prompt": "a"}\n{"messages": []}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_prompt_file(str(jl))


def test_held_out_prompts_are_taken_from_the_corpus():
    from specserve.train.corpus import held_out_prompts

    assert load_prompts("held-out", 2) == held_out_prompts(2)


def test_plain_args_drop_only_speculative_flags():
    args = ServerArgs(model_path="m", speculative_algorithm="NGRAM", speculative_num_draft_tokens=8,
                      max_total_tokens=1000, num_threads=1)
    plain = plain_args(args)
    assert plain.speculative_algorithm is None and plain.speculative_num_draft_tokens is None
    assert (plain.model_path, plain.max_total_tokens, plain.num_threads) == ("m", 1000, 1)


def _run(texts: list[str], tokens: list[int], seconds: float, **spec) -> RunResult:
    return RunResult(texts, [{"completion_tokens": n, **spec} for n in tokens], seconds)


SETUP = {"algorithm": "EAGLE", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4, "prompts": "held-out",
         "batch_size": 1, "max_new_tokens": 8, "temperature": 0.0}


def test_summarize_and_format_table_by_hand():
    plain = _run(["x", "y"], [8, 8], 4.0)  # 16 tokens in 4 s: 4 tok/s
    # prompt 1: 4 verify steps, positions accepted [3, 2, 1]; prompt 2: 2 steps, [2, 0, 0] -> [5, 2, 1] over 6
    spec = RunResult(["x", "z"], [
        {"completion_tokens": 8, "spec_verify_ct": 4, "spec_accept_per_position": [3, 2, 1]},
        {"completion_tokens": 8, "spec_verify_ct": 2, "spec_accept_per_position": [2, 0, 0]},
    ], 2.0)
    s = summarize(plain, spec, SETUP)
    assert (s["verify_steps"], s["accepted_per_position"], s["greedy_match"]) == (6, [5, 2, 1], 1)
    assert s["accept_length"] == pytest.approx(16 / 6)
    assert s["accept_rate_per_position"] == pytest.approx([5 / 6, 2 / 6, 1 / 6])
    assert (s["plain_tokens_per_s"], s["spec_tokens_per_s"], s["speedup"]) == (4.0, 8.0, 2.0)
    table = format_table(s).splitlines()
    assert table[0] == "speculative decoding: EAGLE  (steps 3, topk 1, draft tokens 4)"
    rows = {line[:22].strip(): line[22:].split() for line in table[3:11]}
    assert rows["tokens/s"] == ["4.0", "8.0"] and rows["speed-up"] == ["2.00x"]
    assert rows["accept length"] == ["2.67"] and rows["greedy outputs equal"] == ["1/2"]
    assert table[-2].split() == ["position", "1", "2", "3"]
    assert table[-1].split() == ["rate", "0.833", "0.333", "0.167"]
    sampled = summarize(plain, spec, {**SETUP, "temperature": 0.7})
    assert sampled["greedy_match"] is None and "n/a (sampled)" in format_table(sampled)


@pytest.fixture(scope="module")
def eagle(model_factory, tmp_path_factory):
    from specserve.test.tiny import make_eagle_head_dir

    target = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)
    return target, make_eagle_head_dir(str(tmp_path_factory.mktemp("eval-eagle")), target, kind="self")


def test_eval_acceptance_eagle_held_out(eagle, tmp_path, capsys):
    target, head = eagle
    out = tmp_path / "eval.json"
    rc = cli_main(["eval-acceptance", "--model-path", target, "--speculative-algorithm", "EAGLE",
                   "--speculative-draft-model-path", head, "--speculative-num-steps", "3",
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--prompts", "held-out",
                   "--num-prompts", "3", "--max-new-tokens", "12", "--batch-size", "2", "--num-threads", "1",
                   "--log-level", "warning", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["num_prompts"] == 3 and s["greedy_match"] == 3  # lossless: every text equals plain decoding's
    assert s["spec_tokens"] == s["plain_tokens"] > 0 and s["verify_steps"] > 0
    assert s["accept_length"] == pytest.approx(s["spec_tokens"] / s["verify_steps"]) and s["accept_length"] > 1.5
    rates = s["accept_rate_per_position"]
    assert 1 <= len(rates) <= 3 and all(0.0 <= r <= 1.0 for r in rates)
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert rates == pytest.approx([c / s["verify_steps"] for c in s["accepted_per_position"]])
    assert s["speedup"] == pytest.approx(s["spec_tokens_per_s"] / s["plain_tokens_per_s"])
    printed = capsys.readouterr().out
    assert format_table(s) in printed and "greedy outputs equal" in printed


def test_eval_acceptance_ngram_sampled_from_jsonl(model_factory, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["a b c d a b c d a b", "x = 1\ny = 2\nx = 1\n"]))
    out = tmp_path / "eval.json"
    rc = cli_main(["eval-acceptance", "--model-path", model_factory("llama"), "--speculative-algorithm", "NGRAM",
                   "--speculative-num-draft-tokens", "4", "--prompts", str(prompts), "--max-new-tokens", "8",
                   "--temperature", "0.8", "--ignore-eos", "--num-threads", "1", "--log-level", "warning",
                   "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["num_prompts"] == 2 and s["greedy_match"] is None and s["temperature"] == 0.8
    assert s["spec_tokens"] == s["plain_tokens"] == 16  # --ignore-eos: exactly max-new-tokens each
    assert s["verify_steps"] > 0 and all(0.0 <= r <= 1.0 for r in s["accept_rate_per_position"])
    assert "n/a (sampled)" in capsys.readouterr().out


def test_eval_acceptance_needs_a_speculative_algorithm(llama_dir, capsys):
    assert cli_main(["eval-acceptance", "--model-path", llama_dir, "--num-prompts", "1"]) == 2
    assert "--speculative-algorithm is required" in capsys.readouterr().err
