"""Self-generated training data: the pure pieces on hand-checked inputs, and the whole pass on a tiny chat model."""

from __future__ import annotations

import pytest

from specserve.train import selfgen
from specserve.train.selfgen import (
    GenOptions,
    Sample,
    clean_prompt,
    dedup,
    dedup_key,
    is_held_out,
    pre_query,
    prompt_plan,
    read_jsonl,
    unseen,
    write_jsonl,
)


def _render(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_pre_query_cuts_the_template_where_the_user_text_starts():
    assert pre_query(_render, "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_prompt_plan_is_a_function_of_the_seed_and_mixes_kinds():
    plan = prompt_plan(400, seed=3)
    assert plan == prompt_plan(400, seed=3) and plan != prompt_plan(400, seed=4)
    kinds = [k for k, _, _ in plan]
    assert {"chat", "code", "text"} <= set(kinds)
    assert all(opening == "" for k, _, opening in plan if k == "chat")
    assert all(opening for k, _, opening in plan if k != "chat")
    assert 0.4 < kinds.count("chat") / len(kinds) < 0.6


@pytest.mark.parametrize("text, opening, finish, want", [
    (" Paris in two words?", "", "stop", "Paris in two words?"),
    ("computes a mean.", "Write a Python function that", "stop", "Write a Python function that computes a mean."),
    ("x = 1", "Fix the bug in this code:\n", "stop", "Fix the bug in this code:\nx = 1"),
    ("What is the capital of", "", "length", None),  # cut by the token limit
    ("Hi", "", "stop", None),  # too short
    ("Tell me <|im_start|> more about it", "", "stop", None),  # template markup
])
def test_clean_prompt(text, opening, finish, want):
    assert clean_prompt(text, opening, finish) == want


def test_dedup_ignores_case_and_spacing_and_keeps_the_first():
    a, b, c = Sample("Tell me  a Joke", "chat", "x"), Sample("tell me a joke", "chat", "y"), Sample("Other", "t", "z")
    assert dedup([a, b, c]) == [a, c]
    assert dedup_key(" A\n b ") == "a b"


def test_unseen_drops_requests_an_earlier_shard_has():
    a, b, c = Sample("Tell me a joke", "chat", "x"), Sample("Other", "t", "y"), Sample("New one", "t", "z")
    assert unseen([Sample("tell me  A joke", "chat", "w"), c, b], earlier=[a, b]) == [c]
    assert unseen([a], earlier=[]) == [a]


def test_held_out_split_is_stable_and_about_one_in_25():
    prompts = [f"question number {i}" for i in range(5000)]
    held = [p for p in prompts if is_held_out(p)]
    assert 150 < len(held) < 260  # 200 expected
    assert all(is_held_out(p.upper()) for p in held)  # the dedup key decides, so case does not move a prompt


def test_jsonl_round_trip(tmp_path):
    samples = [Sample("Q?", "chat", "t", "A.", "stop"), Sample("Write a poem", "text", "u")]
    write_jsonl(str(tmp_path / "s.jsonl"), samples)
    assert read_jsonl(str(tmp_path / "s.jsonl")) == samples


def test_generate_dataset_on_a_tiny_chat_model(model_factory, monkeypatch):
    """The whole pass through a real Engine: prompts sampled from the pre-query template, kept ones answered
    greedily (the answer equals a plain greedy run on the rendered prompt), the split disjoint."""
    from specserve import Engine

    monkeypatch.setattr(selfgen, "clean_prompt", lambda text, opening, finish: (opening + text).strip() or None)
    target = model_factory("llama")
    opts = GenOptions(num_prompts=12, prompt_tokens=8, answer_tokens=6, batch_size=4)
    train, held = selfgen.generate_dataset(target, opts, progress=False)
    assert train and all(s.completion for s in train) and not any(s.completion for s in held)
    assert not {s.prompt for s in train} & {s.prompt for s in held}
    with Engine(model_path=target) as e:
        render_prompt = selfgen.chat_renderers(e.tokenizer)[1]
        got = e.generate([render_prompt(s.prompt) for s in train], {"max_new_tokens": 6, "temperature": 0})
    assert [g["text"] for g in got] == [s.completion for s in train]  # every answer at its own request


def test_sampled_prompts_do_not_depend_on_how_many_run_at_once(model_factory, monkeypatch):
    """Each sampled request has its own seed (from its index), so the requests the model writes are the same
    whether the engine decodes 2 or 12 of them at a time, and whatever the engine's own seed (float32)."""
    from specserve import Engine

    monkeypatch.setattr(selfgen, "clean_prompt", lambda text, opening, finish: (opening + text).strip() or None)
    target = model_factory("llama")
    opts = GenOptions(num_prompts=12, prompt_tokens=8, seed=3)
    got = []
    for running in (2, 12):
        with Engine(model_path=target, max_running_requests=running, dtype="float32", random_seed=running) as e:
            render = selfgen.chat_renderers(e.tokenizer)[0]
            got.append([s.prompt for s in selfgen.sample_prompts(e, render, opts, progress=False)])
    assert len(set(got[0])) > 1 and got[0] == got[1]
