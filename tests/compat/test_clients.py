"""The frameworks users point at an OpenAI-compatible server, used as their docs show, against specserve:
LangChain's ChatOpenAI with no model named (it sends its own default) and litellm with ``openai/<any name>``.
Answers are checked against /generate's greedy answer to the same chat prompt."""

from __future__ import annotations

import os

import pytest

from specserve.utils import terminate_process
from tests.server.conftest import start_server

QUESTION = "Write a function that adds two numbers."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    s = start_server(model_factory("llama"), str(tmp_path_factory.mktemp("clients") / "server.log"))
    yield s
    terminate_process(s.proc)


@pytest.fixture(scope="module")
def expected(server) -> str:
    """The greedy answer through the OpenAI endpoint the frameworks call, asked by the official client."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="None")
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].message.content


def test_langchain_chat_openai_without_a_model_name(server, expected):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="None", temperature=0, max_tokens=MAX_TOKENS,
                     extra_body={"ignore_eos": True})
    msg = llm.invoke(QUESTION)
    assert msg.content == expected
    assert msg.response_metadata["model_name"] == server.model  # it asked for its own default name
    assert msg.usage_metadata["output_tokens"] == MAX_TOKENS
    streamed = "".join(chunk.content for chunk in llm.stream(QUESTION))
    assert streamed == expected


def test_litellm_with_any_openai_model_name(server, expected):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    import litellm

    kwargs = {"model": "openai/my-local-model", "api_base": server.url + "/v1", "api_key": "None",
              "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": MAX_TOKENS,
              "extra_body": {"ignore_eos": True}}
    r = litellm.completion(**kwargs)
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == MAX_TOKENS
    chunks = litellm.completion(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
