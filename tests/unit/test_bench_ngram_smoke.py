"""Smoke run of the NGRAM vs transformers prompt-lookup benchmark on the tiny model, plus its pure helpers."""

import json

from specserve.bench.bench_ngram import ENGINES, copied_chars, format_table, main, repeat_prompt, top_level_functions


def test_top_level_functions_and_repeat_prompt():
    text = ("import x\n\ndef f(a):\n    b = a\n\n    return b\n\n\n"
            "class C:\n    def m(self):\n        pass\ndef g():\n    pass\n")
    assert top_level_functions(text) == ["def f(a):\n    b = a\n\n    return b", "def g():\n    pass"]
    assert repeat_prompt("def g():\n    pass") == "def g():\n    pass\n\n\ndef g():"


def test_copied_chars():
    prompt = "def g():\n    pass\n\n\ndef g():"  # body after the first "def g():" is "\n    pass\n\n\n"
    assert copied_chars(prompt, "\n    pass\n") == 10
    assert copied_chars(prompt, "\n    return") == 5
    assert copied_chars("a\nb", "xyz") == 0  # last line "b" does not occur earlier


def test_bench_ngram_smoke(tmp_path, llama_dir):
    out = tmp_path / "ngram.json"
    report = main(["--model-path", llama_dir, "--num-prompts", "2", "--max-new-tokens", "6", "--lookup-tokens", "3",
                   "--always-speculate", "--num-threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["setup"]["dtype"] == "float32" and report["setup"]["lookup_tokens"] == 3
    assert report["setup"]["ngram_num_draft_tokens"] == 12  # default: the max match window
    assert [s["set"] for s in report["sets"]] == ["repetitive", "open-ended"]
    for s in report["sets"]:
        assert s["num_prompts"] == 2
        tps = s["tokens_per_s"]
        for name in ENGINES:
            assert s["engines"][name]["tokens"] == 12 and tps[name] > 0
        assert s["ngram_equals_ours_plain"] == 2  # lossless in float32
        assert s["hf_lookup_equals_hf_plain"] == 2
        assert 1.0 <= s["ngram_accept_length"] <= 12
        assert abs(s["speedup_ngram_over_ours_plain"] - tps["ours_ngram"] / tps["ours_plain"]) < 1e-9
    assert len(report["sets"][0]["copied_chars"]) == 2 and report["sets"][1]["copied_chars"] is None
    table = format_table(report)
    assert "repetitive" in table and "open-ended" in table and "prompt_lookup_num_tokens=3" in table
