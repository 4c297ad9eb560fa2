"""The bundled demo model family (built by ``specserve build-demo``; see ``specserve.train.demo``).

Names usable wherever a model, draft or token-map path is expected: ``demo`` (the Llama target), ``demo-eagle``
(EAGLE-2 head), ``demo-eagle3`` (EAGLE-3 head), ``demo-draft`` (STANDALONE draft), ``demo-mtp`` (MiMo-style model
with an MTP layer) and ``demo/fr_spec_1024.pt`` (FR-Spec token map). A local path of the same name wins.
"""

from __future__ import annotations

import os

DEMO_ROOT = os.path.dirname(os.path.abspath(__file__))
DEMO_NAMES = ("demo", "demo-eagle", "demo-eagle3", "demo-draft", "demo-mtp")
TOKEN_MAP = "demo/fr_spec_1024.pt"


def demo_path(name: str) -> str:
    """Absolute path of a bundled folder or file, e.g. demo_path("demo-eagle3")."""
    return os.path.join(DEMO_ROOT, *name.split("/"))


def resolve_demo(path: str | None) -> str | None:
    """'demo', 'demo-eagle3', 'demo/fr_spec_1024.pt' -> the bundled path, unless a local path of that name exists."""
    if path is None or os.path.exists(path):
        return path
    first = path.split("/", 1)[0]
    return demo_path(path) if first in DEMO_NAMES else path


def demo_available() -> bool:
    """True when the bundled weights are present (a source checkout before the first build has none)."""
    return all(os.path.isfile(os.path.join(demo_path(n), "config.json")) for n in DEMO_NAMES)
