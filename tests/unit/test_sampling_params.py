import dataclasses

import pytest

from specserve.sampling import SamplingParams

EXPECTED_DEFAULTS = {
    "max_new_tokens": 128,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
    "seed": None,
    "logit_bias": None,
    "return_logprob": False,
    "top_logprobs_num": 0,
    "logprob_start_len": -1,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "temp_scaled_logprobs": False,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
}


def test_defaults_match_sglang():
    p = SamplingParams()
    init_fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert init_fields == set(EXPECTED_DEFAULTS)
    for name, value in EXPECTED_DEFAULTS.items():
        assert getattr(p, name) == value, name
    assert SamplingParams.from_dict(None) == p
    assert SamplingParams.from_dict({}) == p
    p.verify(vocab_size=10)  # defaults are valid


def test_from_dict_sets_fields_and_accepts_ints_for_floats():
    p = SamplingParams.from_dict(
        {"temperature": 0, "top_p": 1, "max_new_tokens": 7, "stop": ["a"], "logit_bias": {"3": 2}}
    )
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.top_p == 1.0 and isinstance(p.top_p, float)
    assert p.max_new_tokens == 7
    assert p.stop == ["a"]


def test_from_dict_unknown_key():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", True),
        ("top_k", 2.0),
        ("n", False),
        ("seed", "42"),
        ("ignore_eos", 1),
        ("stop", 3),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 5),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {"1": "big"}),
    ],
)
def test_from_dict_bad_types(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("min_new_tokens", 200),  # > max_new_tokens (128)
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("presence_penalty", 2.1),
        ("presence_penalty", -3.0),
        ("n", 0),
        ("top_logprobs_num", -1),
        ("seed", 2**70),
        ("stop_token_ids", [3, 10]),  # vocab_size 10
        ("stop_token_ids", [-1]),
        ("logit_bias", {"10": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"3": 100.5}),
        ("logit_bias", {"3": -101.0}),
    ],
)
def test_verify_out_of_range_names_field(field, value):
    p = SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError) as exc:
        p.verify(vocab_size=10)
    assert str(exc.value).startswith(field), str(exc.value)


def test_verify_message_format():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1).verify()


def test_verify_accepts_boundaries():
    SamplingParams(
        max_new_tokens=None, min_new_tokens=5, temperature=0.0, top_p=1.0, top_k=0, min_p=1.0,
        repetition_penalty=2.0, frequency_penalty=-2.0, presence_penalty=2.0, stop_token_ids=[0, 9],
        logit_bias={"9": 100.0, 0: -100.0}, seed=-5, top_logprobs_num=0,
    ).verify(vocab_size=10)
    SamplingParams(top_k=1, min_new_tokens=128).verify()
    SamplingParams(stop_token_ids=[10**6]).verify()  # no vocab size: only >= 0 is checked


def test_verify_checks_types_of_directly_built_params():
    with pytest.raises(ValueError, match="^top_k"):
        SamplingParams(top_k="5").verify()


def test_normalize():
    p = SamplingParams(stop="###", top_k=0, temperature=1e-7, logit_bias={"5": 1.5, 7: -2}).normalize()
    assert p.stop == ["###"]
    assert p.stop_str_max_len == 3
    assert p.top_k == -1
    assert p.temperature == 0.0 and p.is_greedy
    assert p.logit_bias == {5: 1.5, 7: -2.0}
    assert all(isinstance(k, int) for k in p.logit_bias)

    q = SamplingParams(stop=["", "ab", "abcd", ""]).normalize()
    assert q.stop == ["ab", "abcd"] and q.stop_str_max_len == 4
    assert SamplingParams().normalize().stop == [] and SamplingParams().normalize().stop_str_max_len == 0


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_normalize_does_not_hide_a_negative_temperature():
    p = SamplingParams(temperature=-1.0).normalize()
    with pytest.raises(ValueError, match="^temperature"):
        p.verify()


def test_grammar_fields_are_strings_and_exclusive():
    assert SamplingParams.from_dict({"regex": "[0-9]+"}).grammar == ("regex", "[0-9]+")
    assert SamplingParams().grammar is None
    with pytest.raises(ValueError, match="json_schema must be a string"):
        SamplingParams.from_dict({"json_schema": {"type": "object"}})
    with pytest.raises(ValueError, match="only one of json_schema, regex, ebnf and structural_tag"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'}).normalize().verify()
    with pytest.raises(ValueError, match="structural_tag must be a string"):
        SamplingParams.from_dict({"structural_tag": {"format": {}}})
