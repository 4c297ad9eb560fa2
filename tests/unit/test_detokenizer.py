import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specserve.sampling import SamplingParams
from specserve.sampling.detokenizer import (
    STOP_REGEX_LOOKBACK,
    IncrementalDetokenizer,
    StopChecker,
    find_stop,
    find_stop_regex,
    partial_stop_len,
    regex_lookback,
)

TRAIN_LINES = [
    "héllo wörld ✓ 日本語 🙂",
    "hello world, hello there",
    "the end of the world is near",
    "日本語 is Japanese ✓ and so is 東京",
] * 3

# Texts for the checks; 🎉 and ß never appear in training, so they stay split into single-byte tokens.
TEXTS = [
    "héllo wörld ✓ 日本語 🙂",
    "party 🎉🎉 time, straße ✓",
    "hello there STOP here",
    "東京 🙂 é",
]


@pytest.fixture(scope="module")
def tok():
    """A tiny byte-level BPE trained at test time, wrapped as a transformers fast tokenizer."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(TRAIN_LINES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


@pytest.fixture(scope="module")
def sp_tok():
    """A sentencepiece-style tokenizer: a word's leading '▁' decodes to a space, except at the start."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    t.train_from_iterator(["hello world hello there", "the world is near"] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")


def stream(detok, ids, chunk=1):
    chunks = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return chunks


def test_fixture_splits_multibyte_characters(tok):
    # The checks below are only meaningful if some characters span several tokens.
    assert len(tok.encode("🎉", add_special_tokens=False)) > 1
    assert any("\ufffd" in tok.decode([i]) for i in tok.encode(TEXTS[0], add_special_tokens=False))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_text_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    assert full == text
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids, chunk)
    assert "".join(chunks) == detok.text
    assert full.startswith(detok.text)
    assert detok.flush() == ""  # text without U+FFFD: nothing held back at the end
    assert detok.text == full


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_matches_decode_after_flush(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    for k in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tok)
        emitted = "".join(stream(detok, ids[:k])) + detok.flush()
        expected = tok.decode(ids[:k])  # may end in U+FFFD when k splits a character; flush emits it
        assert emitted == detok.text == expected, k


def test_no_partial_character_is_emitted(tok):
    text = "party 🎉🎉 time, straße ✓ héllo"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # some tokens were held back while a character was incomplete
    assert detok.text == text


def test_special_tokens(tok):
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id] + tok.encode(" world")
    skipping = IncrementalDetokenizer(tok, skip_special_tokens=True)
    stream(skipping, ids)
    assert skipping.text == "hello world" == tok.decode(ids, skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    stream(keeping, ids)
    assert keeping.text == "hello<eos> world" == tok.decode(ids, skip_special_tokens=False)


def test_sentencepiece_leading_spaces(sp_tok):
    ids = sp_tok.encode("hello world there", add_special_tokens=False)
    full = sp_tok.decode(ids)
    naive = "".join(sp_tok.decode([i]) for i in ids)
    assert naive != full  # decoding token by token loses the spaces: the window technique is needed
    detok = IncrementalDetokenizer(sp_tok)
    chunks = stream(detok, ids)
    assert "".join(chunks) + detok.flush() == full


# ---------------------------------------------------------------- stop strings


def test_find_stop():
    assert find_stop("hello world", ["wor", "lo"], 0) == (3, "lo")
    assert find_stop("hello world", ["wor", "lo"], 4) == (6, "wor")
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", ["lo"], 4) is None
    assert find_stop("abcd", ["ab", "abc"], 0) == (0, "abc")  # tie at the same index: the longer one
    assert find_stop("abc", [], 0) is None


def test_partial_stop_len():
    assert partial_stop_len("xxab", ["abc"]) == 2
    assert partial_stop_len("xxa", ["abc"]) == 1
    assert partial_stop_len("xxz", ["abc"]) == 0
    assert partial_stop_len("xxabc", ["abc"]) == 0  # a whole stop is a match, not a partial one
    assert partial_stop_len("xxab", ["bq", "abx"]) == 2
    assert partial_stop_len("a", ["abc"]) == 1
    assert partial_stop_len("", ["abc"]) == 0
    assert partial_stop_len("xxab", []) == 0


def _run_checker(tok, text, **params):
    checker = StopChecker(tok, SamplingParams(**params).normalize())
    out, matched = [], None
    for i in tok.encode(text, add_special_tokens=False):
        piece, m = checker.add([i])
        out.append(piece)
        if m is not None:
            assert matched is None
            matched = m
    return checker, out, matched


def test_stop_string_spanning_tokens_is_trimmed(tok):
    text = "hello there STOP here and more"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "P he"
    # the stop string really spans several tokens
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    checker, out, matched = _run_checker(tok, text, stop=stop)
    assert matched == stop
    assert "".join(out) == "hello there STO" == checker.text
    assert checker.finished
    assert all("P" not in piece for piece in out)  # the stop's start was held back, never half-emitted
    assert checker.add(tok.encode(" more", add_special_tokens=False)) == ("", None)
    assert checker.flush() == ""


def test_stop_string_kept_with_no_stop_trim(tok):
    text = "hello there STOP here and more"
    _, out, matched = _run_checker(tok, text, stop=["zzz", "P he"], no_stop_trim=True)
    assert matched == "P he"
    assert "".join(out) == "hello there STOP he"


def test_stop_string_inside_multibyte_tokens(tok):
    _, out, matched = _run_checker(tok, "héllo wörld", stop="ö")  # ö is split over tokens
    assert matched == "ö"
    assert "".join(out) == "héllo w"
    assert all("\ufffd" not in piece for piece in out)


def test_partial_stop_held_back_then_released(tok):
    checker, out, matched = _run_checker(tok, "hello STO", stop="STOP")
    assert matched is None
    assert "".join(out) == "hello "  # "STO" could still become "STOP"
    assert checker.flush() == "STO"  # finished for another reason: release it
    assert checker.text == "hello STO"


def test_no_stop_strings_streams_everything(tok):
    checker, out, matched = _run_checker(tok, TEXTS[1])
    assert matched is None
    assert "".join(out) == TEXTS[1]
    assert checker.flush() == ""


# ---------------------------------------------------------------- stop regexes
def test_find_stop_regex_only_matches_ending_in_the_new_text():
    pats = [(re.compile(r"and|or"), 3), (re.compile(r"[.!?]\s*$"), 1024)]
    assert find_stop_regex("cats and dogs", pats, 0) == (5, r"and|or", 3)
    assert find_stop_regex("cats and dogs", pats, 8) is None  # "and" ended before the new text
    assert find_stop_regex("cats an", pats, 6) is None
    assert find_stop_regex("cats and", pats, 7) == (5, r"and|or", 3)  # completed by the new "d"
    assert find_stop_regex("Done. ", pats, 5) == (4, r"[.!?]\s*$", 2)
    assert find_stop_regex("Done. Then", pats, 6) is None  # "$" no longer holds


def test_regex_lookback_is_the_longest_match_where_known():
    assert regex_lookback(re.compile("and|or")) == 3
    assert regex_lookback(re.compile("a+")) == STOP_REGEX_LOOKBACK  # unbounded


def test_stop_regex_trims_at_the_match_and_reports_the_pattern(tok):
    text = "hello there STOP here and more"
    checker, out, matched = _run_checker(tok, text, stop_regex=r"S[A-Z]+P")
    assert matched == r"S[A-Z]+P" and checker.finished
    assert "".join(out) == checker.text and text.startswith(checker.text) and "STOP" not in checker.text
    kept = _run_checker(tok, text, stop_regex=r"S[A-Z]+P", no_stop_trim=True)[0]
    assert kept.text == "hello there STOP"


def test_the_earlier_of_a_stop_string_and_a_stop_regex_wins(tok):
    text = "one two three four"
    assert _run_checker(tok, text, stop=["four"], stop_regex=r"t[wh]")[2] == r"t[wh]"
    assert _run_checker(tok, text, stop=["one"], stop_regex=r"t[wh]")[2] == "one"


def test_invalid_stop_regex_names_the_field():
    with pytest.raises(ValueError, match="stop_regex: '\\(' is not a valid regular expression"):
        SamplingParams.from_dict({"stop_regex": ["ok", "("]})
