"""Loading HF folders: sharded safetensors, dtypes, and the errors users get for bad paths."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers

from specserve.models.loader import ModelLoadError, load_model, resolve_model_path
from specserve.models.spec import UnsupportedModelError


def test_sharded_checkpoint_with_index_loads_identically(model_factory, tmp_path):
    src = model_factory("llama")
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, _, _ = load_model(src, "float32")
    b, _, _ = load_model(str(sharded), "float32")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


@pytest.mark.parametrize("dtype,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                            ("auto", torch.float32)])
def test_dtype_choice(model_factory, dtype, expected):
    model, _, _ = load_model(model_factory("qwen3"), dtype)
    assert {p.dtype for p in model.parameters()} == {expected}


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_hub_id_not_cached_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_path("some-org/some-model-that-is-not-here")


def test_unsupported_architecture_names_it(model_factory, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_factory("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        load_model(str(d))


def test_missing_weight_is_reported(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(model_factory("llama"), d)
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    os.remove(d / "model.safetensors")
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="gate_up_proj"):
        load_model(str(d))
