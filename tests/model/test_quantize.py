"""Weight-only int8 / int4 linears (``--torchao-config``): the quantizers on hand-checked weights, the module's
integer kernel against its dense copy, and the engine: its greedy output equals an unquantized engine's on a
checkpoint holding the dequantized weights (so the integer kernels compute the same model), and speculative
decoding on the quantized target equals plain decoding on it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import Engine
from specserve.config import ConfigError, ServerArgs
from specserve.models import quantize as Q
from specserve.test.tiny import make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

CONFIGS = ["int8wo", "int4wo-32", "int4wo-64"]


def test_int8_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, s = Q.quantize_int8(w)
    assert s.tolist() == pytest.approx([2 / 127, 1.0])  # a zero row gets scale 1
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 and 31.75 round to 64 and 32
    assert Q.dequantize_int8(q, s)[0].tolist() == pytest.approx([128 / 127, -2.0, 64 / 127])


def test_int4_by_hand():
    # group 32: one group of 0, 1, ..., 31 -> lo 0, scale 31 / 15; a constant group -> scale 1, every q 0
    w = torch.stack([torch.arange(32.0), torch.full((32,), 3.0)])  # [2, 32]
    q, s, z = Q.quantize_int4(w, 32)
    assert s.view(-1).tolist() == pytest.approx([31 / 15, 1.0])
    assert z.view(-1).tolist() == pytest.approx([8 * 31 / 15, 11.0])
    assert q[0, [0, 1, 2, 31]].tolist() == [0, 0, 1, 15] and q[1].eq(0).all()  # round(v * 15 / 31)
    back = Q.dequantize_int4(q, s, z, 32)
    assert back[1].tolist() == [3.0] * 32  # (0 - 8) * 1 + 11
    assert (back[0] - w[0]).abs().max() <= 31 / 15 / 2 + 1e-6  # within half a step


def test_int4_keeps_weights_on_its_grid():
    """A weight whose groups already hold 16 evenly spaced levels comes back exactly."""
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (16, 64), generator=gen).float()
    levels[:, ::32] = 0
    levels[:, 1::32] = 15  # each group spans the full 0..15
    w = levels * 0.25 - 1.0
    q, s, z = Q.quantize_int4(w, 32)
    assert torch.equal(Q.dequantize_int4(q, s, z, 32), w)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_match_the_dense_copy(name, dtype):
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(128, 48, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 128, generator=gen) * 0.1)
    ql = Q.QuantLinear(lin, Q.parse_torchao_config(name))
    x = torch.randn(Q.QUANT_MAX_ROWS + 3, 128, generator=gen).to(dtype)
    small = torch.cat([ql(x[i:i + 1]) for i in range(x.shape[0])])  # the integer kernel, one row at a time
    large = ql(x)  # more than QUANT_MAX_ROWS rows: the dense copy
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(small.float(), large.float(), atol=tol, rtol=tol)
    err = (large.float() - lin(x).float()).norm() / lin(x).float().norm()  # quantization error, a few percent
    assert err < (0.02 if name == "int8wo" else 0.15)


def test_shapes_the_kernel_refuses_stay_as_they_were():
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 64))  # N 40: not a multiple of 16
    done, kept = Q.quantize_linears(model, Q.parse_torchao_config("int4wo-32"))
    assert (done, kept) == (0, 2)  # the second's K (40) is not a multiple of 32 either
    done, kept = Q.quantize_linears(model, Q.parse_torchao_config("int8wo"))
    assert (done, kept) == (2, 0) and all(isinstance(m, Q.QuantLinear) for m in model)
    assert Q.quantize_linears(model, Q.parse_torchao_config("int8wo")) == (0, 0)  # dense copies are left alone


@pytest.mark.parametrize("value, message", [("int4wo-16", "--torchao-config"), ("fp8wo", "--torchao-config"),
                                            ("int8dq", "--torchao-config")])
def test_bad_torchao_config_names_the_flag(value, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        ServerArgs(model_path="m", torchao_config=value).validate()


def test_quantization_flag():
    assert ServerArgs(model_path="m.gguf", quantization="GGUF").validate().quantization == "gguf"
    with pytest.raises(ConfigError, match="^--quantization awq"):
        ServerArgs(model_path="m", quantization="awq").validate()
    with pytest.raises(ConfigError, match="^--torchao-config"):
        ServerArgs(model_path="m", torchao_config="int8wo", tp_size=2).validate()
    assert ServerArgs(model_path="m", torchao_config=" INT4WO-128 ").validate().torchao_config == "int4wo-128"


def _dequantized_checkpoint(src: str, dst: str, name: str) -> str:
    """A copy of the model folder whose linear weights are replaced by their quantized-then-dequantized values."""
    shutil.copytree(src, dst)
    cfg = Q.parse_torchao_config(name)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for key, w in tensors.items():
        if key.endswith("_proj.weight") or key == "lm_head.weight":
            if cfg.bits == 8 or key == "lm_head.weight":  # the LM head is int8 under int4 configs
                back = Q.dequantize_int8(*Q.quantize_int8(w))
            else:
                back = Q.dequantize_int4(*Q.quantize_int4(w, cfg.group), cfg.group)
            tensors[key] = back.to(w.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_runs_the_dequantized_model(name, llama_dir, tmp_path, monkeypatch):
    """Greedy outputs (batch 1 and a batch of 8) equal those of the same model with the dequantized weights written
    to its checkpoint, and the integer kernels did the one-row work."""
    calls = {"n": 0}
    for op in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu"):
        real = getattr(torch, op)

        def counted(*a, _real=real):
            calls["n"] += 1
            return _real(*a)
        monkeypatch.setattr(torch, op, counted)
    ref_dir = _dequantized_checkpoint(llama_dir, str(tmp_path / "deq"), name)
    with Engine(model_path=ref_dir, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        want_one = e.generate(PROMPTS[0], greedy(24))["output_ids"]
    with Engine(model_path=llama_dir, max_total_tokens=4096) as e:
        plain_bytes = e.scheduler.runner.weight_bytes()
    with Engine(model_path=llama_dir, max_total_tokens=4096, torchao_config=name) as e:
        assert e.get_server_info()["torchao_config"] == name
        # held: the dense copies (float32 here, as the plain weights) plus the integer weights and their scales
        assert plain_bytes < e.scheduler.runner.weight_bytes() < plain_bytes * 1.5
        one = e.generate(PROMPTS[0], greedy(24))["output_ids"]
        assert calls["n"] > 0
        outs = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        assert_no_kv_leak(e)
    assert one == want_one and outs == want


def test_speculation_on_a_quantized_target_equals_plain_decoding(target, tmp_path):
    """EAGLE over an int4 target: the same tokens as plain decoding of that target, drafting checked."""
    head = make_eagle_head_dir(str(tmp_path / "head"), target, kind="self")
    with Engine(model_path=target, max_total_tokens=4096, torchao_config="int4wo-32") as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS, greedy(32))]
    with Engine(model_path=target, max_total_tokens=4096, torchao_config="int4wo-32",
                disable_speculative_auto_off=True, **spec_kwargs("EAGLE", head, 3, 2, 5)) as e:
        outs = e.generate(PROMPTS, greedy(32))
        alone = e.generate(PROMPTS[1], greedy(32))
    assert [o["output_ids"] for o in outs] == want and alone["output_ids"] == want[1]
    assert_drafting_happened(outs, min_accept_length=1.5)


@pytest.fixture(scope="module")
def target(model_factory):
    """The mirror target of the speculative tests (one layer, unit embeddings): its self head drafts well."""
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)
