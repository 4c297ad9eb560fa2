"""ServerArgs validation and the command line generated from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specserve.cli import add_server_args, main, server_args_from
from specserve.config import ConfigError, ServerArgs, flag_name


def parse(argv: list[str]) -> ServerArgs:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return server_args_from(p.parse_args(argv))


def test_every_field_is_a_flag_with_help():
    p = argparse.ArgumentParser()
    add_server_args(p)
    text = p.format_help()
    for f in dataclasses.fields(ServerArgs):
        assert flag_name(f.name) in text
        assert f.metadata.get("help"), f.name


def test_sglang_aliases_and_types():
    args = parse(["--model", "m", "--mem-fraction", "0.6", "--max-total-tokens", "100", "--disable-radix-cache",
                  "--dtype", "bf16", "--speculative-draft-model", "d"])
    assert args.model_path == "m" and args.mem_fraction_static == 0.6 and args.max_total_tokens == 100
    assert args.disable_radix_cache is True and args.dtype == "bfloat16"
    assert args.speculative_draft_model_path == "d"


@pytest.mark.parametrize("argv,flag", [
    (["--dtype", "int3"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--schedule-policy", "random"], "--schedule-policy"),
    (["--mem-fraction-static", "1.2"], "--mem-fraction-static"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--port", "70000"], "--port"),
    (["--log-level", "loud"], "--log-level"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
    (["--enable-torch-compile"], "--enable-torch-compile"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=f"^{flag}"):
        parse(argv)


def test_speculative_defaults_max_running_requests():
    assert ServerArgs().effective_max_running_requests == 256
    assert dataclasses.replace(ServerArgs(), speculative_algorithm="EAGLE").effective_max_running_requests == 48


def test_generate_command_reports_bad_flag(capsys, model_factory):
    assert main(["generate", "hi", "--model-path", model_factory("llama"), "--schedule-policy", "x"]) == 2
    assert "--schedule-policy" in capsys.readouterr().err


def test_generate_command_runs(capsys, model_factory):
    assert main(["generate", "def f(x):", "--model-path", model_factory("llama"), "--max-new-tokens", "5",
                 "--max-total-tokens", "256"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def f(x):")
    assert "5 tokens" in captured.err
