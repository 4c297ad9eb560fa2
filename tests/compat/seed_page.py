"""The eight server examples of SGLang's "Speculative Decoding" documentation page, as a user runs them: each
launch cell and its client cell, code as the page prints it (its log output left out).

A test runs a cell with two changes only, the ones the README promises: ``sglang`` becomes ``specserve``, and
the page's Hugging Face model paths become the bundled demo family (no hub here). The client cells run
unchanged, so they send the page's own model names.
"""

from __future__ import annotations

import os
import re

# The first cell of the page: the notebook's imports.
IMPORT_CELL = '''\
from sglang.test.doc_patch import launch_server_cmd
from sglang.utils import wait_for_server, print_highlight, terminate_process

import openai
'''

_CHAT = '''\
client = openai.Client(base_url=f"http://127.0.0.1:{port}/v1", api_key="None")

response = client.chat.completions.create(
    model="%s",
    messages=[
        {"role": "user", "content": "List 3 countries and their capitals."},
    ],
    temperature=0,
    max_tokens=64,
)

print_highlight(f"Response: {response}")
'''


def _launch(command: str) -> str:
    return f'server_process, port = launch_server_cmd(\n    """\n{command}\n"""\n)\n\n' \
        'wait_for_server(f"http://localhost:{port}", process=server_process)\n'


# name -> (launch cell, client cell)
CELLS: dict[str, tuple[str, str]] = {
    "eagle2": (_launch(
        "python3 -m sglang.launch_server --model meta-llama/Llama-2-7b-chat-hf  --speculative-algorithm EAGLE \\\n"
        "    --speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 \\\n"
        "    --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --cuda-graph-max-bs 8 --log-level warning"),
        _CHAT % "meta-llama/Llama-2-7b-chat-hf"),
    "eagle2_torch_compile": (_launch(
        "python3 -m sglang.launch_server --model meta-llama/Llama-2-7b-chat-hf  --speculative-algorithm EAGLE \\\n"
        "    --speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 5 \\\n"
        "        --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --mem-fraction 0.6 \\\n"
        "            --enable-torch-compile --torch-compile-max-bs 2 --log-level warning"),
        _CHAT % "meta-llama/Llama-2-7b-chat-hf"),
    "eagle2_fr_spec": (_launch(
        "python3 -m sglang.launch_server --model meta-llama/Meta-Llama-3-8B-Instruct --speculative-algorithm EAGLE \\\n"
        "    --speculative-draft-model-path lmsys/sglang-EAGLE-LLaMA3-Instruct-8B --speculative-num-steps 5 \\\n"
        "    --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --speculative-token-map "
        "thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt \\\n"
        "    --mem-fraction 0.7 --cuda-graph-max-bs 2 --dtype float16  --log-level warning"),
        _CHAT % "meta-llama/Meta-Llama-3-8B-Instruct"),
    "eagle3": (_launch(
        "python3 -m sglang.launch_server --model meta-llama/Llama-3.1-8B-Instruct  --speculative-algorithm EAGLE3 \\\n"
        "    --speculative-draft-model-path jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B "
        "--speculative-num-steps 5 \\\n"
        "        --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 --mem-fraction 0.6 \\\n"
        "        --cuda-graph-max-bs 2 --dtype float16 --log-level warning"),
        _CHAT % "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    "mtp": (_launch(
        "    python3 -m sglang.launch_server --model-path XiaomiMiMo/MiMo-7B-RL --host 0.0.0.0 --trust-remote-code \\\n"
        "    --speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 2 \\\n"
        "    --mem-fraction 0.5 --log-level warning"),
        '''\
import requests

url = f"http://localhost:{port}/v1/chat/completions"

data = {
    "model": "XiaomiMiMo/MiMo-7B-RL",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
}

response = requests.post(url, json=data)
print_highlight(response.json())
'''),
    "standalone": (_launch(
        "python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm STANDALONE \\\n"
        "    --speculative-draft-model-path Qwen/Qwen2.5-1.5B-Instruct \\\n"
        "    --speculative-num-steps 4 --speculative-eagle-topk 2 --speculative-num-draft-tokens 7 \\\n"
        "    --cuda-graph-max-bs 8 --mem-fraction-static 0.7 --log-level warning"),
        _CHAT % "Qwen/Qwen2.5-7B-Instruct"),
    "spec_v2": (_launch(
        "SGLANG_ENABLE_SPEC_V2=True python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct "
        "--speculative-algorithm STANDALONE \\\n"
        "    --speculative-draft-model-path Qwen/Qwen2.5-1.5B-Instruct \\\n"
        "    --speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5 \\\n"
        "    --cuda-graph-max-bs 8 --mem-fraction-static 0.7 --log-level warning"),
        _CHAT % "Qwen/Qwen2.5-7B-Instruct"),
    "ngram": (_launch(
        "python3 -m sglang.launch_server --model Qwen/Qwen2.5-7B-Instruct --speculative-algorithm NGRAM \\\n"
        "    --speculative-num-draft-tokens 16 \\\n"
        "    --speculative-ngram-max-match-window-size 12 --speculative-ngram-max-bfs-breadth 10 \\\n"
        "    --cuda-graph-max-bs 8 --mem-fraction-static 0.8 --log-level warning"),
        _CHAT % "Qwen/Qwen2.5-7B-Instruct"),
}

# The page's model paths -> the bundled demo family that stands in for them.
DEMO_FOR = {
    "meta-llama/Llama-2-7b-chat-hf": "demo",
    "meta-llama/Meta-Llama-3-8B-Instruct": "demo",
    "meta-llama/Llama-3.1-8B-Instruct": "demo",
    "Qwen/Qwen2.5-7B-Instruct": "demo",
    "lmsys/sglang-EAGLE-llama2-chat-7B": "demo-eagle",
    "lmsys/sglang-EAGLE-LLaMA3-Instruct-8B": "demo-eagle",
    "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B": "demo-eagle3",
    "thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt": "demo/fr_spec_1024.pt",
    "XiaomiMiMo/MiMo-7B-RL": "demo-mtp",
    "Qwen/Qwen2.5-1.5B-Instruct": "demo-draft",
}

SPECULATIVE_FLAGS = re.compile(r"--speculative-[a-z-]+ \S+|--enable-torch-compile|--torch-compile-max-bs \S+|"
                               r"SGLANG_ENABLE_SPEC_V2=\S+ ")


def as_specserve(cell: str, demo_models: bool = True) -> str:
    """A cell with ``sglang`` -> ``specserve`` and (demo_models) the page's model paths -> the demo family."""
    if demo_models:
        for hub, demo in DEMO_FOR.items():
            cell = cell.replace(hub, demo)
    return cell.replace("sglang", "specserve")


def without_speculation(launch_cell: str) -> str:
    """The same launch with speculative decoding (and what only serves it) taken out: the plain reference."""
    return SPECULATIVE_FLAGS.sub("", launch_cell)


# ---------------------------------------------------------------------------------------------- the page itself
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "seeds",
                    "speculative_decoding.md")
_CODE_END = re.compile(r"^(wait_for_server\(|print_highlight\(|import openai$)")


def page_cells(path: str = PAGE) -> list[str]:
    """The page's code cells in order, each cut after its last code line (the log output the page shows after
    ``wait_for_server(...)`` / ``print_highlight(...)`` is not code)."""
    with open(path, encoding="utf-8") as f:
        chunks = re.split(r"\nIn \[\d+\]:\n", f.read())[1:]
    cells = []
    for chunk in chunks:
        lines = chunk.split("\n")
        end = next((i for i, line in enumerate(lines) if _CODE_END.match(line)), None)
        cells.append("\n".join(lines[: end + 1]) + "\n" if end is not None else chunk)
    return cells
