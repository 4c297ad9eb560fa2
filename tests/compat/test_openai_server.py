"""SGLang's OpenAI-server tests, ported to a real specserve server on CPU with the tiny random Llama, through the
official ``openai`` client:

- ``test/registered/openai_server/basic/test_openai_server.py::TestOpenAIServer`` (completions and chat, plain and
  streamed, over SGLang's parameter grids; regex, penalty, response prefill, model list / retrieve);
- ``test/registered/openai_server/validation/test_openai_server_ignore_eos.py``;
- ``test/registered/openai_server/validation/test_request_length_validation.py`` (the OpenAI-route part).

One server, launched as TestOpenAIServer launches SGLang (``--api-key sk-123456``; the client sends that key), plus
``--context-length 400`` (below the model's 512 positions), the flag the length-validation tests launch with
(SGLang uses 1000 with an 8B model; 400 keeps the tiny model's prompts small).

A random model answers nothing sensible, so checks on meaning (a JSON answer, "SmartHome Mini") become checks on
mechanics; each test's docstring says what it ports and what changed.
"""

from __future__ import annotations

import itertools
import json

import openai
import pytest
import transformers

from specserve.utils import terminate_process
from tests.server.conftest import start_server

API_KEY = "sk-123456"
CONTEXT = 400
PROMPT = "The capital of France is"
SYSTEM = "You are a helpful AI assistant"
CHAT_QUESTION = "What is the capital of France? Answer in a few words."
STREAM_QUESTION = "What is the capital of France?"
INTRODUCE = "Introduce the capital of France."


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("llama")  # 512 positions


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, str(tmp_path_factory.mktemp("openai-server") / "server.log"),
                     "--context-length", str(CONTEXT), api_key=API_KEY)
    yield s
    terminate_process(s.proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def chat_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------- completions
# SGLang's grid: echo x logprobs x list input x n x token input (32 combinations)
GRID = [pytest.param(echo, logprobs, use_list, n, token_input,
                     id=f"echo{int(echo)}-lp{logprobs}-list{int(use_list)}-n{n}-ids{int(token_input)}")
        for echo, logprobs, use_list, n, token_input
        in itertools.product([False, True], [None, 5], [True, False], [1, 2], [False, True])]


def assert_usage_chunk(chunk) -> None:
    """include_usage's last chunk: no choices, every count positive (SGLang's streaming tests)."""
    assert not chunk.choices
    assert chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0 and chunk.usage.total_tokens > 0


def completion_prompt(tokenizer, use_list: bool, token_input: bool):
    """-> (the prompt argument, number of prompts, expected usage.prompt_tokens)."""
    one = tokenizer.encode(PROMPT) if token_input else PROMPT
    n_tokens = len(tokenizer.encode(PROMPT))
    if use_list:
        return [one, one], 2, 2 * n_tokens
    return one, 1, n_tokens


@pytest.mark.parametrize("echo,logprobs,use_list,n,token_input", GRID)
def test_completion(client, server, tokenizer, echo, logprobs, use_list, n, token_input):
    """Ports TestOpenAIServer.test_completion (run_completion) over its 32-combination grid: the choice count, the
    echoed prompt, the logprobs shape (with echo the first token is the prompt's, whose logprob is None), id /
    created, and usage.prompt_tokens == the prompt's token count per prompt (n does not multiply it)."""
    prompt, n_prompts, prompt_tokens = completion_prompt(tokenizer, use_list, token_input)
    out = client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=32, echo=echo,
                                    logprobs=logprobs, n=n)
    assert len(out.choices) == n_prompts * n
    assert [c.index for c in out.choices] == list(range(n_prompts * n))
    if echo:
        for c in out.choices:
            assert c.text.startswith(PROMPT), c.text
    if logprobs:
        lp = out.choices[0].logprobs
        assert lp
        assert isinstance(lp.tokens[0], str)
        assert isinstance(lp.top_logprobs[1], dict) and len(lp.top_logprobs[1]) > 0
        if echo:
            assert lp.token_logprobs[0] is None  # the first prompt token has no prediction
        else:
            assert lp.token_logprobs[0]  # a real (negative) logprob
    else:
        assert out.choices[0].logprobs is None
    assert out.id
    assert out.created
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens > 0
    assert out.usage.total_tokens > 0


@pytest.mark.parametrize("echo,logprobs,use_list,n,token_input", GRID)
def test_completion_stream(client, server, tokenizer, echo, logprobs, use_list, n, token_input):
    """Ports TestOpenAIServer.test_completion_stream (run_completion_stream) over the same grid, with
    stream_options include_usage: the usage chunk's counts, per-chunk logprobs (top_logprobs[0] a non-empty dict
    except in the first chunk of an echo stream, which starts with the prompt's None entry), the first chunk of
    every index starting with the prompt under echo, id / created on every chunk, and every index seen."""
    prompt, n_prompts, _ = completion_prompt(tokenizer, use_list, token_input)
    stream = client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=32, echo=echo,
                                       logprobs=logprobs, n=n, stream=True, stream_options={"include_usage": True})
    seen: set[int] = set()
    usage_chunks = 0
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks += 1
            assert_usage_chunk(chunk)
            continue
        choice = chunk.choices[0]
        first = choice.index not in seen
        if logprobs:
            assert choice.logprobs, f"no logprobs in {chunk}"
            assert isinstance(choice.logprobs.tokens[0], str), chunk
            if not (first and echo):
                top = choice.logprobs.top_logprobs[0]
                assert isinstance(top, dict) and len(top) > 0, chunk
        if first and echo:
            assert choice.text.startswith(PROMPT), choice.text
        seen.add(choice.index)
        assert chunk.id
        assert chunk.created
    assert seen == set(range(n_prompts * n))
    assert usage_chunks == 1


# ---------------------------------------------------------------------------------------------- chat
CHAT_GRID = [pytest.param(lp, n, id=f"lp{lp}-n{n}") for lp in (None, 5) for n in (1, 2)]


@pytest.mark.parametrize("logprobs,n", CHAT_GRID)
def test_chat_completion(client, server, logprobs, n):
    """Ports TestOpenAIServer.test_chat_completion (run_chat_completion), logprobs {None, 5} x n {1, 2}, no
    max_tokens (generation runs to EOS or the context end): exactly `logprobs` top_logprobs per token, n choices,
    an assistant message with str content, id / created, positive usage."""
    out = client.chat.completions.create(model=server.model, messages=chat_messages(CHAT_QUESTION), temperature=0,
                                         logprobs=logprobs is not None, top_logprobs=logprobs, n=n)
    if logprobs:
        content = out.choices[0].logprobs.content
        assert isinstance(content[0].top_logprobs[0].token, str)
        assert len(content[0].top_logprobs) == logprobs
    assert len(out.choices) == n
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.id
    assert out.created
    assert out.usage.prompt_tokens > 0
    assert out.usage.completion_tokens > 0
    assert out.usage.total_tokens > 0


@pytest.mark.parametrize("logprobs,n", CHAT_GRID)
def test_chat_completion_stream(client, server, logprobs, n):
    """Ports TestOpenAIServer.test_chat_completion_stream (run_chat_completion_stream): the usage chunk's counts;
    the first chunk of each index has role "assistant"; every later chunk before the finish carries non-empty
    delta.content (and, with logprobs, exactly `logprobs` top_logprobs); each index gets exactly one chunk with a
    finish_reason; id / created on every chunk."""
    stream = client.chat.completions.create(model=server.model, messages=chat_messages(STREAM_QUESTION),
                                            temperature=0, logprobs=logprobs is not None, top_logprobs=logprobs,
                                            n=n, stream=True, stream_options={"include_usage": True})
    started: set[int] = set()
    finishes = dict.fromkeys(range(n), 0)
    usage_chunks = 0
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks += 1
            assert_usage_chunk(chunk)
            continue
        assert chunk.id
        assert chunk.created
        choice = chunk.choices[0]
        index, delta = choice.index, choice.delta
        assert finishes[index] == 0, f"a chunk for index {index} after its finish chunk: {chunk}"
        if choice.finish_reason is not None:
            finishes[index] += 1
        if index not in started:
            assert delta.role == "assistant", chunk
            started.add(index)
            continue
        if choice.finish_reason is None:
            assert isinstance(delta.content, str) and delta.content != "", f"empty delta mid-stream: {chunk}"
            if logprobs:
                assert choice.logprobs, chunk
                tops = choice.logprobs.content[0].top_logprobs
                assert isinstance(tops, list) and isinstance(tops[0].token, str)
                assert len(tops) == logprobs
    assert started == set(range(n))
    assert finishes == dict.fromkeys(range(n), 1)
    assert usage_chunks == 1


# ---------------------------------------------------------------------------------------------- other methods
REGEX = r"\{\n" + r'   "name": "[\w]+",\n' + r'   "population": [\d]+\n' + r"\}"
JSON_SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
EBNF = 'root ::= "yes" | "no"'


@pytest.mark.parametrize("endpoint,field,value", [
    pytest.param(endpoint, field, value, id=f"{endpoint}-{field}") for endpoint, field, value in [
        ("chat", "regex", REGEX),
        ("chat", "ebnf", EBNF),
        ("completions", "regex", REGEX),
        ("completions", "json_schema", JSON_SCHEMA),
        ("completions", "ebnf", EBNF),
    ]])
def test_regex(client, server, endpoint, field, value):
    """Ports TestOpenAIServer.test_regex (the same regex, prompt, temperature 0 and max_tokens 128), with SGLang's
    json_schema and ebnf variants. SGLang checks that the answer parses as the regex's JSON; the random model may
    fill "[\\w]+" until max_tokens, so that check applies when it finished ("stop"), and in any case the answer
    follows the grammar: the regex's forced opening, a JSON object for the schema, exactly "yes" or "no" for the EBNF
    (a finite language, so it always finishes)."""
    kw = dict(model=server.model, temperature=0, max_tokens=128, extra_body={field: value})
    if endpoint == "chat":
        choice = client.chat.completions.create(messages=chat_messages(INTRODUCE), **kw).choices[0]
        text = choice.message.content
    else:
        choice = client.completions.create(prompt=PROMPT, **kw).choices[0]
        text = choice.text
    assert choice.finish_reason in ("stop", "length")
    if field == "ebnf":
        assert text in ("yes", "no") and choice.finish_reason == "stop"
    elif field == "regex":
        assert text.startswith('{\n   "name": "'), text
        if choice.finish_reason == "stop":
            obj = json.loads(text)
            assert isinstance(obj["name"], str) and isinstance(obj["population"], int)
    else:
        assert text.startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text)["name"], str)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_invalid_stop_regex_is_refused_naming_it(client, server, endpoint):
    """SGLang's stop_regex (not in TestOpenAIServer; its finish is test_matched_stop's): a pattern Python cannot
    compile is a 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            client.chat.completions.create(model=server.model, messages=chat_messages(INTRODUCE), max_tokens=8,
                                           extra_body={"stop_regex": "and|(or"})
        else:
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                      extra_body={"stop_regex": ["x", "and|(or"]})
    assert exc.value.status_code == 400 and "stop_regex" in exc.value.message


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object", "properties": {
        "name": {"type": "string"}, "population": {"type": "integer"}}, "required": ["name", "population"]}}},
], ids=["json_object", "json_schema"])
def test_regex_response_format(client, server, response_format):
    """Ports TestOpenAIServer.test_regex's chat route to OpenAI's response_format (SGLang's chat takes a JSON schema
    through it): the answer is a JSON object; when it finished, it parses and has the schema's keys."""
    choice = client.chat.completions.create(model=server.model, messages=chat_messages(INTRODUCE), temperature=0,
                                            max_tokens=128, response_format=response_format).choices[0]
    assert choice.message.content.lstrip().startswith("{"), choice.message.content
    if choice.finish_reason == "stop":
        obj = json.loads(choice.message.content)
        assert isinstance(obj, dict)
        if response_format["type"] == "json_schema":
            assert {"name", "population"} <= obj.keys()


def test_penalty(client, server):
    """Ports TestOpenAIServer.test_penalty (frequency_penalty=1.0, max_tokens=32: the content is a str), plus a
    check that the penalty acts: greedy decoding with it follows the unpenalized greedy output until that output
    repeats one of its own tokens (only already generated tokens are penalized), and departs from it somewhere."""
    kw = dict(model=server.model, messages=chat_messages(INTRODUCE), temperature=0, max_tokens=32, logprobs=True)
    penalized = client.chat.completions.create(**kw, frequency_penalty=1.0)
    assert isinstance(penalized.choices[0].message.content, str)
    plain = client.chat.completions.create(**kw)
    a = [t.token for t in plain.choices[0].logprobs.content]
    b = [t.token for t in penalized.choices[0].logprobs.content]
    assert len(a) == len(b) == 32
    assert a != b, "frequency_penalty=1.0 changed nothing"
    d = next(i for i in range(32) if a[i] != b[i])
    assert a[d] in a[:d], f"diverged at {d} on a token not generated before: {a[d]!r}"


def test_response_prefill(client, server, tokenizer):
    """Ports TestOpenAIServer.test_response_prefill: the last message is a partial assistant turn "{\\n" and
    extra_body continue_final_message=True, sent under another model's name. SGLang continues that turn: it
    renders the earlier messages with the generation prompt and appends the partial text's tokens, with no end
    of turn. The tiny model will not write "SmartHome Mini", so the check is on mechanics: the server's prompt
    is exactly those tokens (usage.prompt_tokens), and the answer is the greedy continuation of them."""
    partial = "{\n"
    msgs = chat_messages("Extract the name, size, price, and color from this product description as a JSON "
                         "object: The SmartHome Mini is a compact smart home assistant.")
    expected_ids = render_ids(tokenizer, msgs) + tokenizer.encode(partial, add_special_tokens=False)
    closed_ids = render_ids(tokenizer, [*msgs, {"role": "assistant", "content": partial}])
    assert len(closed_ids) != len(expected_ids)  # the turn-closed rendering differs (end marker + new turn)

    out = client.chat.completions.create(model="meta-llama/Llama-3.1-8B-Instruct", temperature=0, max_tokens=32,
                                         messages=[*msgs, {"role": "assistant", "content": partial}],
                                         extra_body={"continue_final_message": True})
    assert out.usage.prompt_tokens == len(expected_ids)
    continuation = client.completions.create(model=server.model, prompt=expected_ids, temperature=0, max_tokens=32)
    assert out.choices[0].message.content == continuation.choices[0].text


def test_model_list(client, server):
    """Ports TestOpenAIServer.test_model_list: exactly one model, with an int max_model_len (here: the
    --context-length the server was started with)."""
    models = list(client.models.list())
    assert len(models) == 1
    max_len = getattr(models[0], "max_model_len", None)
    assert isinstance(max_len, int) and max_len == CONTEXT
    assert models[0].id == server.model


def test_retrieve_model(client, server):
    """Ports TestOpenAIServer.test_retrieve_model: the served model by name (id and root are the model path the
    server was launched with), and openai.NotFoundError (404) for a model that does not exist."""
    model = client.models.retrieve(server.model)
    assert model.id == server.model
    assert model.root == server.model
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("non-existent-model")
    assert exc.value.status_code == 404


ANY_NAMES = ["gpt-3.5-turbo", "meta-llama/Llama-3.1-8B-Instruct", "default"]


@pytest.mark.parametrize("name", ANY_NAMES)
def test_any_model_name_is_served(client, server, name):
    """Ports the model-name handling TestOpenAIServer relies on (test_response_prefill sends
    "meta-llama/Llama-3.1-8B-Instruct" to a server of another model): SGLang does not check the request's model
    name, any name is answered by the served model, the same answer as under the served name."""
    kw = dict(temperature=0, max_tokens=8)
    chat = client.chat.completions.create(model=name, messages=chat_messages(CHAT_QUESTION), **kw)
    chat_ref = client.chat.completions.create(model=server.model, messages=chat_messages(CHAT_QUESTION), **kw)
    assert chat.choices[0].message.content == chat_ref.choices[0].message.content
    comp = client.completions.create(model=name, prompt=PROMPT, **kw)
    comp_ref = client.completions.create(model=server.model, prompt=PROMPT, **kw)
    assert comp.choices[0].text == comp_ref.choices[0].text


@pytest.mark.parametrize("name", ANY_NAMES)
def test_response_names_the_served_model(client, server, name):
    """SGLang builds every response and stream chunk with ``model=request.model`` (the name the client sent);
    specserve names the model that answered, as OpenAI's API does (asked for "gpt-4o", it answers with the dated
    model's name). A deliberate difference, documented in the README; clients read the text, not this field."""
    kw = dict(temperature=0, max_tokens=4)
    chat = client.chat.completions.create(model=name, messages=chat_messages(CHAT_QUESTION), **kw)
    assert chat.model == server.model
    comp = client.completions.create(model=name, prompt=PROMPT, **kw)
    assert comp.model == server.model
    chunks = list(client.chat.completions.create(model=name, messages=chat_messages(CHAT_QUESTION), stream=True,
                                                 **kw))
    assert chunks and all(c.model == server.model for c in chunks)


# ---------------------------------------------------------------------------------------------- validation
def test_ignore_eos(client, server, tokenizer):
    """Ports test_openai_server_ignore_eos.py::test_ignore_eos: the same chat request with ignore_eos False and True
    (max_tokens=200); with ignore_eos the answer is longer than the default one or reaches max_tokens, and ends
    with finish_reason "length". A random model never picks EOS by itself, so both requests give EOS a +100
    logit_bias: the default request stops on it at once, the ignore_eos one must run on to max_tokens."""
    max_tokens = 200
    kw = dict(model=server.model, temperature=0, max_tokens=max_tokens,
              messages=[{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "Count from 1 to 20."}],
              logit_bias={str(tokenizer.eos_token_id): 100})
    default = client.chat.completions.create(**kw, extra_body={"ignore_eos": False})
    ignoring = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert default.choices[0].finish_reason == "stop"
    assert default.usage.completion_tokens < max_tokens
    assert ignoring.usage.completion_tokens > default.usage.completion_tokens
    assert ignoring.usage.completion_tokens >= max_tokens
    assert ignoring.choices[0].finish_reason == "length"


def hello_count_over_context(tokenizer) -> int:
    """The fewest "hello " repeats whose chat prompt ([user]) reaches the context length (SGLang's "hello " * 999
    case with a 1000-token context: just over the limit)."""
    k = next(k for k in range(1, CONTEXT) if len(render_ids(tokenizer, [{"role": "user", "content": "hello " * k}]))
             >= CONTEXT)
    assert len(render_ids(tokenizer, [{"role": "user", "content": "hello " * (k - 1)}])) < CONTEXT
    return k


def test_input_length_longer_than_context_length(client, server):
    """Ports test_request_length_validation.py::test_input_length_longer_than_context_length: a chat prompt far
    over the context ("hello " * 1200) -> openai.BadRequestError mentioning "is longer than the model's context
    length"."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello " * 1200}],
                                       temperature=0)
    assert "is longer than the model's context length" in str(exc.value)


def test_input_length_longer_than_maximum_allowed_length(client, server, tokenizer):
    """Ports test_request_length_validation.py::test_input_length_longer_than_maximum_allowed_length: a chat prompt
    just at/over the limit (SGLang refuses a prompt of context_len tokens or more) -> BadRequestError, same
    message; one "hello " fewer is accepted."""
    k = hello_count_over_context(tokenizer)
    ok = client.chat.completions.create(model=server.model, temperature=0,
                                        messages=[{"role": "user", "content": "hello " * (k - 1)}])
    assert ok.choices[0].finish_reason == "length"  # ran to the end of the context
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello " * k}],
                                       temperature=0)
    assert "is longer than the model's context length" in str(exc.value)


def test_input_length_longer_than_context_length_streaming(client, server):
    """Ports test_request_length_validation.py::test_input_length_longer_than_context_length_streaming: the same
    over-long prompt with stream=True is refused up front (HTTP 400, not an error event inside a 200 stream)."""
    with pytest.raises(openai.BadRequestError) as exc:
        stream = client.chat.completions.create(model=server.model, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "hello " * 1200}])
        list(stream)
    assert "is longer than the model's context length" in str(exc.value)


def test_max_tokens_validation(client, server):
    """Ports test_request_length_validation.py::test_max_tokens_validation: chat max_tokens beyond the context
    length (1200 > 400) -> BadRequestError mentioning "max_completion_tokens is too large"."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello "}],
                                       temperature=0, max_tokens=1200)
    assert "max_completion_tokens is too large" in str(exc.value)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_length_validation(client, server, tokenizer, stream):
    """Ports test_request_length_validation.py to /v1/completions (SGLang applies the same tokenizer-manager checks
    there): a prompt of context_len tokens, and a prompt plus max_tokens beyond the context, are 400s, streamed or
    not."""
    token = tokenizer.encode("hello")[0]

    def create(prompt: list[int], max_tokens: int):
        out = client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=stream)
        return list(out) if stream else out

    with pytest.raises(openai.BadRequestError):
        create([token] * CONTEXT, 1)
    with pytest.raises(openai.BadRequestError):
        create([token] * 10, 1200)


def test_prompt_plus_max_tokens_reaching_context(client, server, tokenizer):
    """The boundary of the length check. SGLang's TokenizerManager refuses prompt + max_new_tokens >= context_len;
    specserve serves a request that fills the context exactly (its last token is at the last position) and refuses
    one token more, with SGLang's message."""
    token = tokenizer.encode("hello")[0]
    ok = client.completions.create(model=server.model, prompt=[token] * 100, max_tokens=CONTEXT - 100,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == CONTEXT - 100
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=server.model, prompt=[token] * 100, max_tokens=CONTEXT - 99, temperature=0)
    assert "exceeds the model's maximum context length" in str(exc.value)
