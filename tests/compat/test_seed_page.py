"""SGLang's speculative-decoding page, run as a user runs it: each of its eight server examples starts with the
page's flags and answers the page's client cell (the page's model name included); then the same server's greedy
answer to that chat prompt, as token ids through /generate, is compared with the same launch's without
speculation, and the accept metrics show that drafts were verified and accepted. (The client cells themselves
are not compared: the MTP cell samples, having no temperature, and the others are the same request.)

The page's examples run the demo family in its own half precision (bf16, or the float16 some cells ask for).
There a verify forward over a tree rounds differently from a one-token decode step (as plain decoding's own
batches do: a prompt decoded alone and in a batch can differ), so where the target's two best tokens are within
rounding of each other the two runs may pick differently. The check is therefore token by token: the ids are
equal, or equal up to a position where the plain run's best two tokens are a near tie (NEAR_TIE nats) and each run
took one of them. Float32 equality, exact, is what tests/spec checks for every algorithm.
"""

from __future__ import annotations

import os

import pytest
import requests
from transformers import AutoTokenizer

from specserve.demo_models import demo_path
from tests.compat.seed_page import CELLS, IMPORT_CELL, PAGE, as_specserve, page_cells, without_speculation

NEAR_TIE = 0.1  # nats: a bf16 logit near 10 has a rounding step of 0.0625
GREEDY_TOKENS = 64  # the page's max_tokens

_REFERENCES: dict[str, dict] = {}


def run_cells(launch: str, client: str) -> tuple[object, dict, dict]:
    """Runs the import cell, a launch cell and a client cell in one namespace, as a notebook does, then asks
    the same server for the same answer as token ids (/generate, greedy, top-2 logprobs); stops the server.
    Returns (the client cell's `response`, /get_server_info after the answer, the /generate result)."""
    ns: dict = {}
    exec(as_specserve(IMPORT_CELL), ns)  # noqa: S102 - the page's cells are the test's subject
    exec(launch, ns)  # noqa: S102
    try:
        exec(as_specserve(client, demo_models=False), ns)  # noqa: S102 - the client cell runs unchanged
        url = f"http://127.0.0.1:{ns['port']}"
        info = requests.get(url + "/get_server_info", timeout=60).json()
        assert requests.post(url + "/flush_cache", timeout=60).status_code == 200  # compute the prompt again
        ids = requests.post(url + "/generate", timeout=600, json={
            "input_ids": prompt_ids(launch, client), "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": GREEDY_TOKENS}}).json()
        return ns["response"], info, ids
    finally:
        exec("terminate_process(server_process)", ns)  # noqa: S102 - the page's last cell of each section


def prompt_ids(launch: str, client: str) -> list[int]:
    """The client cell's chat prompt as the server renders it (the target's chat template)."""
    model = "demo-mtp" if "demo-mtp" in launch else "demo"
    tok = AutoTokenizer.from_pretrained(demo_path(model))
    question = "What is the capital of France?" if "demo-mtp" in launch else "List 3 countries and their capitals."
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def answer(response) -> dict:
    """The client cell's chat completion as a dict (the MTP cell posts with requests, the others use openai)."""
    if isinstance(response, requests.Response):
        assert response.status_code == 200, response.text
        return response.json()
    return response.model_dump()


def check_answer(body: dict, served: str) -> None:
    """A well-formed chat completion of the served model: text, a finish reason, usage that adds up."""
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length") and body["model"] == served
    usage = body["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def reference(launch: str, client: str) -> dict:
    """The greedy /generate answer of the same launch without speculative decoding (cached per launch)."""
    plain = without_speculation(launch)
    if plain not in _REFERENCES:
        response, info, ids = run_cells(plain, client)
        assert info["speculative_algorithm"] is None
        _REFERENCES[plain] = ids
    return _REFERENCES[plain]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.parametrize("name", list(CELLS))
def test_seed_example_answers_as_plain_decoding(name, monkeypatch):
    """The page's launch and client cells as written; the server speculates at every step (the environment's
    SPECSERVE_DISABLE_SPECULATIVE_AUTO_OFF=1): where plain steps measure faster on this CPU the batch policy would
    run them, and which steps it tried would depend on timing, so the drafting guard below would too."""
    monkeypatch.setenv("SPECSERVE_DISABLE_SPECULATIVE_AUTO_OFF", "1")
    launch, client = CELLS[name]
    launch = as_specserve(launch)
    response, info, spec = run_cells(launch, client)
    check_answer(answer(response), "demo-mtp" if name == "mtp" else "demo")
    plain = reference(launch, client)
    k = first_difference(spec["output_ids"], plain["output_ids"])
    if k is not None:  # only at a near tie of the target: the two runs took its two best tokens
        (best_lp, best, _), (second_lp, second, _) = plain["meta_info"]["output_top_logprobs"][k]
        # (an exact tie, common among bf16 logits, lists the two in either order)
        assert {plain["output_ids"][k], spec["output_ids"][k]} == {best, second}, (k, best, second)
        assert best_lp - second_lp < NEAR_TIE, (k, best_lp, second_lp)
    assert info["speculative_algorithm"] is not None
    assert info["spec_verify_ct"] > 0 and info["avg_spec_accept_length"] > 1.0  # drafts verified and accepted


def test_seed_examples_serve_the_page_model_name():
    """The client cells send the page's model names; the server answers under its own served name."""
    launch, client = CELLS["eagle2"]
    response, _, _ = run_cells(without_speculation(as_specserve(launch)), client)
    check_answer(answer(response), "demo")


@pytest.mark.skipif(not os.path.isfile(PAGE), reason="the documentation page (shared/seeds) is not beside the repo")
def test_cells_are_the_pages_own():
    """The cells above are the page's, character for character (when the page is at hand: a checkout with shared/
    beside it, as CI has)."""
    cells = page_cells()
    assert IMPORT_CELL in cells
    for launch, client in CELLS.values():
        i = cells.index(launch)
        assert cells[i + 1] == client
