"""SGLang's own benchmark client, ``bench_serving.py`` (from SGLang's PyPI wheel, unchanged: the Makefile fetches
it), against ``specserve serve`` with each of its SGLang backends: the native /generate stream, /v1/completions
and /v1/chat/completions. A local ShareGPT-format file stands in for the dataset (no hub here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specserve.demo_models import demo_path
from specserve.utils import terminate_process
from tests.server.conftest import start_server

BENCH_SERVING = os.path.join(sys.prefix, "share", "sglang-clients", "sglang", "bench_serving.py")
PROMPTS, OUTPUT_LEN = 6, 16

QUESTIONS = ["Write a function that reverses a string.", "def fibonacci(n):", "Explain what a Python list is.",
             "import os\nfor name in os.listdir('.'):", "class Stack:\n    def __init__(self):",
             "How do I read a file line by line in Python?", "def is_prime(n):", "Sort a dictionary by value."]


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory) -> str:
    """A ShareGPT-format dataset: a JSON list of {"conversations": [human turn, gpt turn]}."""
    path = tmp_path_factory.mktemp("dataset") / "sharegpt.json"
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": q},
                                             {"from": "gpt", "value": "Here is one way to do it in Python."}]}
            for i, q in enumerate(QUESTIONS)]
    path.write_text(json.dumps(rows))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo target with its EAGLE-3 head (the README's default server)."""
    s = start_server(demo_path("demo"), str(tmp_path_factory.mktemp("bench") / "server.log"),
                     "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "demo-eagle3")
    yield s
    terminate_process(s.proc)


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_runs_end_to_end(backend, server, sharegpt, tmp_path):
    assert os.path.isfile(BENCH_SERVING), f"{BENCH_SERVING} is missing: `make venv` fetches it"
    out = tmp_path / "result.jsonl"
    cmd = [sys.executable, BENCH_SERVING, "--backend", backend, "--base-url", server.url,
           "--model", demo_path("demo"), "--dataset-name", "sharegpt", "--dataset-path", sharegpt,
           "--num-prompts", str(PROMPTS), "--sharegpt-output-len", str(OUTPUT_LEN), "--request-rate", "inf",
           "--max-concurrency", "3", "--disable-tqdm", "--output-file", str(out), "--output-details"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["completed"] == PROMPTS and not any(result["errors"])
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN  # ignore_eos: every request runs to the end
    assert all(n == OUTPUT_LEN for n in result["output_lens"])
    assert all(text for text in result["generated_texts"])
    assert "Accept length" in proc.stdout  # read from the server's internal_states
    accept = float(proc.stdout.split("Accept length:")[1].split()[0])
    assert accept > 1.0
