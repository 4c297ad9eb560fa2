"""Fixtures shared by the speculative-decoding tests."""

from __future__ import annotations

import pytest

from specserve.test.tiny import make_eagle_head_dir


@pytest.fixture(scope="session")
def target(model_factory):
    """The mirror target: one layer + unit-RMS embeddings, so an EAGLE "self" head mirrors it and its drafts are
    mostly accepted. Files that need another target define their own ``target``."""
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def self_head(target, tmp_path_factory):
    """An EAGLE head that mirrors ``target`` (drafts close to the target's own argmax)."""
    return make_eagle_head_dir(str(tmp_path_factory.mktemp("eagle") / "self"), target, kind="self")
