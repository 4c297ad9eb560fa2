"""Every bad input answers its status with OpenAI's error body, and the server keeps serving afterwards."""

from __future__ import annotations

import pytest

from tests.server.conftest import CONTEXT

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 4, **kw}


BAD_JSON = [
    # (name, path, body, status, param)
    ("zero max_tokens", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_completion_tokens", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature above 2", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("negative temperature", COMPLETIONS, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p above 1", COMPLETIONS, {"prompt": "x", "top_p": 1.01}, 400, "top_p"),
    ("penalty out of range", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("n zero", CHAT, chat(n=0), 400, "n"),
    ("prompt + max_tokens beyond context", COMPLETIONS, {"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("chat beyond context", CHAT, chat(max_tokens=CONTEXT), 400, "max_tokens"),
    ("max_tokens of the wrong type", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    ("temperature of the wrong type", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("stream of the wrong type", CHAT, chat(stream="yes"), 400, "stream"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("token id above the vocabulary", COMPLETIONS, {"prompt": [1, 10**6]}, 400, "prompt"),
    ("negative token id", "/generate", {"input_ids": [3, -1]}, 400, "input_ids"),
    ("logit bias out of range", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    ("top_logprobs above 20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("unknown sampling param", "/generate", {"text": "x", "sampling_params": {"max_new_token": 3}}, 400,
     "sampling_params"),
    ("unknown /generate field", "/generate", {"text": "x", "bogus": 1}, 400, "bogus"),
    ("both text and input_ids", "/generate", {"text": "x", "input_ids": [3]}, 400, "prompt"),
    ("one rid for two requests of a batch", "/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400, "rid"),
]


def assert_error_body(resp, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(server) -> None:
    r = server.post(COMPLETIONS, json={"prompt": "def f(x):", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name,path,body,status,param", BAD_JSON, ids=[b[0] for b in BAD_JSON])
def test_bad_json_request(server, name, path, body, status, param):
    assert_error_body(server.post(path, json=body), status, param)
    assert_still_serving(server)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/generate"])
def test_malformed_json(server, path):
    r = server.post(path, data=b'{"prompt": "x", ', headers={"Content-Type": "application/json"})
    assert assert_error_body(r, 400)["code"] == "invalid_json"
    r = server.post(path, data=b'{"prompt": "x", "temperature": NaN}', headers={"Content-Type": "application/json"})
    assert assert_error_body(r, 400)["code"] == "invalid_json"
    r = server.post(path, data=b'["a list"]', headers={"Content-Type": "application/json"})
    assert_error_body(r, 400)
    assert_still_serving(server)


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "messages", '[{"role": "user", "content": "a\\ud800b"}]'),
    (COMPLETIONS, "prompt", '"a\\udfffb"'),
    ("/generate", "text", '["fine", "a\\ud800b"]'),
])
def test_lone_surrogates_and_deep_nesting_are_bad_requests(server, path, field, value):
    """JSON may escape half of a UTF-16 surrogate pair alone, which is no Unicode character; and a body nested
    deeper than the parser recurses. Both are the client's error (400), not the server's."""
    json_type = {"Content-Type": "application/json"}
    r = server.post(path, data=f'{{"{field}": {value}, "max_tokens": 2}}'.encode(), headers=json_type)
    assert "surrogate" in assert_error_body(r, 400, field)["message"]
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert assert_error_body(server.post(path, data=deep, headers=json_type), 400)["code"] == "invalid_json"
    assert_still_serving(server)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_wrong_content_type(server, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    r = server.post(CHAT, data=b'{"messages": [{"role": "user", "content": "hi"}]}', headers=headers)
    assert assert_error_body(r, 400)["code"] == "invalid_content_type"
    assert_still_serving(server)


def test_unknown_route_and_method(server):
    assert_error_body(server.get("/v1/nothing-here"), 404)
    assert_error_body(server.get(CHAT), 405)
    assert_still_serving(server)


def test_openai_client_raises_the_right_errors(client, server):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=MSG, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nothing")
    # any model name is served (SGLang's rule; LangChain sends gpt-3.5-turbo), answered under the served name
    r = client.chat.completions.create(model="gpt-nothing", messages=MSG, max_tokens=1)
    assert r.model == server.model and r.usage.completion_tokens == 1
