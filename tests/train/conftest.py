"""Fixtures of the trainer tests."""

from __future__ import annotations

import pytest
import torch

from specserve.test.tiny import corpus_text, make_model_dir


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory, tokenizer_dir):
    """A target whose next token depends on the current token only (every layer passes its input through): a
    function a head can learn in a hundred steps, so the training signal shows in the accept length."""
    d = str(tmp_path_factory.mktemp("bigram"))
    return make_model_dir(d, "llama", tokenizer_dir=tokenizer_dir, identity_layers=True, unit_embeddings=True,
                          num_hidden_layers=4, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokens(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return torch.tensor(tok(corpus_text(60_000))["input_ids"], dtype=torch.int32)
