"""The launcher's command line: SGLang flag names, start-up failures that name the flag, and the utils."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from specserve import cli, launch_server
from specserve.utils import free_port, split_command
from tests.server.conftest import server_env

ISSUE_FLAGS = [
    "--model-path", "--model", "--tokenizer-path", "--host", "--port", "--dtype", "--device", "--context-length",
    "--mem-fraction-static", "--mem-fraction", "--max-running-requests", "--max-total-tokens",
    "--max-queued-requests", "--chunked-prefill-size", "--disable-radix-cache", "--schedule-policy",
    "--served-model-name", "--chat-template", "--api-key", "--random-seed", "--trust-remote-code", "--log-level",
    "--enable-metrics", "--cuda-graph-max-bs", "--disable-cuda-graph", "--enable-torch-compile",
    "--torch-compile-max-bs", "--speculative-algorithm", "--speculative-draft-model-path",
    "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
]


@pytest.mark.parametrize("argv", [["--help"], None])
def test_help_lists_the_sglang_flags(capsys, argv):
    with pytest.raises(SystemExit) as e:
        if argv is None:
            cli.main(["serve", "--help"])
        else:
            launch_server.main(argv)
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ISSUE_FLAGS:
        assert f"{flag} " in text or f"{flag}," in text or f"{flag}\n" in text, flag


@pytest.mark.parametrize("argv,flag", [
    (["--port", "70000"], "--port"),
    (["--dtype", "int4"], "--dtype"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--log-level", "chatty"], "--log-level"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"], "--speculative-eagle-topk"),
    ([], "--model-path"),
])
def test_bad_flag_fails_at_start_naming_it(capsys, argv, flag, llama_dir):
    if flag != "--model-path":
        argv = ["--model-path", llama_dir, *argv]
    assert launch_server.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {flag}")


def test_busy_port_fails_naming_the_flag(capsys, llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert launch_server.main(["--model-path", llama_dir, "--port", str(port)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --port {port}")


def test_unloadable_model_fails_with_the_reason(tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = subprocess.run([sys.executable, "-m", "specserve.launch_server", "--model-path", missing,
                        "--port", str(free_port())],
                       capture_output=True, text=True, env=server_env(), timeout=300)
    assert r.returncode == 2
    assert r.stderr.rstrip().splitlines()[-1].startswith("error: --model-path") and "does not exist" in r.stderr


def test_split_command_handles_notebook_cells():
    argv, env = split_command("""
SGLANG_ENABLE_SPEC_V2=True python3 -m specserve.launch_server --model m \\
    --speculative-num-steps 4 --log-level warning
""")
    assert env == {"SGLANG_ENABLE_SPEC_V2": "True"}
    assert argv == [sys.executable, "-m", "specserve.launch_server", "--model", "m", "--speculative-num-steps", "4",
                    "--log-level", "warning"]
    assert split_command("/opt/bin/tool -x 'a b'") == (["/opt/bin/tool", "-x", "a b"], {})
