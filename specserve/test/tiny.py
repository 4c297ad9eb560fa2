"""Tiny HF-format models with random weights, built locally (no downloads) for tests and benchmarks.

``build_tokenizer`` trains a small byte-level BPE tokenizer (with a chat template) on text that ships with
every Python install; ``make_model_dir`` writes a transformers-initialised random model of a chosen
architecture next to it. Logits are made peaky (the final norm is scaled) so greedy choices do not flip
between numerically different but equivalent computations (batched vs single, chunked vs whole).
"""

from __future__ import annotations

import json
import os
import sysconfig

import torch

from specserve.models.loader import dtype_name
from specserve.train.tokenizer import train_tokenizer


def corpus_text(max_chars: int = 200_000) -> str:
    """Python source from the running interpreter's standard library (present on every machine)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    parts, size = [], 0
    for name in ("textwrap.py", "string.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py"):
        path = os.path.join(stdlib, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
            size += len(parts[-1])
        if size >= max_chars:
            break
    parts.append("héllo wörld ✓ 日本語 🙂 naïve café\n")
    return "".join(parts)[:max_chars]


def build_tokenizer(out_dir: str, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on ``corpus_text()`` and save it (tokenizer.json + config) into out_dir."""
    return train_tokenizer([corpus_text()], vocab_size, out_dir)


ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides):
    import transformers

    cfg_cls = getattr(transformers, ARCH_CONFIGS[arch][0])
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=6,
    )
    if arch == "qwen3":
        kw["head_dim"] = 32
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    cfg.architectures = [ARCH_CONFIGS[arch][1]]
    return cfg


def make_model_dir(
    out_dir: str,
    arch: str = "llama",
    seed: int = 0,
    logit_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: str | None = None,
    unit_embeddings: bool = False,
    identity_layers: bool = False,
    **config_overrides,
) -> str:
    """Write a random `arch` model (+ tokenizer) as an HF folder; returns out_dir.

    unit_embeddings: rescale every embedding row to RMS 1 (so the first input norm is the identity; this is what
    lets ``make_eagle_head_dir(kind="self")`` build a head that mirrors a one-layer target).
    identity_layers: zero every layer's o_proj and down_proj, so each layer passes its input through and the model
    is a bigram model, logits = lm_head(norm(embed(token))): the target ``make_eagle3_head_dir(kind="self")``
    mirrors."""
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    if tokenizer_dir is None:
        tok = build_tokenizer(out_dir)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        tok.save_pretrained(out_dir)
    vocab = config_overrides.pop("vocab_size", len(tok))
    cfg = tiny_config(arch, vocab_size=vocab, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(logit_scale)
        if unit_embeddings:
            emb = model.model.embed_tokens.weight
            emb.div_(emb.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-6))  # the pad row stays zero
        if identity_layers:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    _set_dtype(out_dir, dtype)
    return out_dir


def _set_dtype(out_dir: str, dtype: torch.dtype) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = dtype_name(dtype)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def make_eagle_head_dir(out_dir: str, target_dir: str, kind: str = "self", seed: int = 0) -> str:
    """Write an EAGLE-1/2 draft head (``LlamaForCausalLMEagle`` format) for the target in target_dir.

    kind="self": fc picks the token embedding and ignores the hidden state, and layer 0 is a copy of the target's
    layer 0. For a ONE-layer target built with ``unit_embeddings=True`` the head then reproduces the target's next
    token prediction (up to the first token of the sequence, which the EAGLE shift never shows it), so drafts are
    mostly accepted: a draft whose acceptance is known to be high, for tests.
    kind="random": random weights (drafts mostly rejected).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = {}
    with safe_open(os.path.join(target_dir, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.startswith("model.layers.0.") and "input_layernorm" not in name:
                tensors[name.removeprefix("model.")] = f.get_tensor(name).float()
    h = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    if kind == "self":
        fc = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    elif kind == "random":
        fc = torch.randn(h, 2 * h, generator=gen) * 0.05
        for name, t in tensors.items():
            if "layernorm" not in name:
                tensors[name] = torch.randn(t.shape, generator=gen) * 0.05
    else:
        raise ValueError(f"kind must be 'self' or 'random', got {kind!r}")
    tensors["fc.weight"], tensors["fc.bias"] = fc, torch.zeros(h)
    dtype = getattr(torch, cfg.get("torch_dtype") or "float32")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    cfg.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def make_eagle3_head_dir(out_dir: str, target_dir: str, kind: str = "self", draft_vocab: list[int] | None = None,
                         seed: int = 0, aux_layer_ids: list[int] | None = None) -> str:
    """Write an EAGLE-3 draft head (``LlamaForCausalLMEagle3`` format) for the target in target_dir.

    draft_vocab: target ids of the draft vocabulary, in draft-id order (written as ``d2t``); None = the target's
    vocabulary and LM head.
    kind="self": mirrors a target built with ``identity_layers=True, unit_embeddings=True`` (a bigram model):
    ``fc`` is zero (so the residual is zero), the attention is multi-head with q = 16*[I|0] and k = v = [I|0] over
    [embed | hidden] and o = I, so every query attends (softmax margin > 20 on unit embeddings) to its own token
    and the head outputs that token's embedding; the MLP is zero and the LM head holds the target's rows. Fed the
    target's captured layers (first draft level) the head predicts exactly the target's next token, so that draft
    is accepted whenever the token is in the draft vocabulary; deeper levels receive the head's own output as
    hidden, which this construction does not cancel, so they are mostly rejected. kind="random": random weights.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    with safe_open(os.path.join(target_dir, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        lm_head = f.get_tensor("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight").float()
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = h // heads
    eye, zero = torch.eye(h), torch.zeros(h, h)
    gen = torch.Generator().manual_seed(seed)
    rows = lm_head if draft_vocab is None else lm_head[torch.tensor(draft_vocab)]
    t = {
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rows,
    }
    if kind == "self":
        t.update({
            "fc.weight": torch.zeros(h, 3 * h),
            "midlayer.self_attn.q_proj.weight": 16.0 * torch.cat([eye, zero], 1),
            "midlayer.self_attn.k_proj.weight": torch.cat([eye, zero], 1),
            "midlayer.self_attn.v_proj.weight": torch.cat([eye, zero], 1),
            "midlayer.self_attn.o_proj.weight": eye.clone(),
            "midlayer.mlp.gate_proj.weight": torch.zeros(inter, h),
            "midlayer.mlp.up_proj.weight": torch.zeros(inter, h),
            "midlayer.mlp.down_proj.weight": torch.zeros(h, inter),
        })
    elif kind == "random":
        shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (h, 2 * h),
                  "midlayer.self_attn.k_proj.weight": (h, 2 * h), "midlayer.self_attn.v_proj.weight": (h, 2 * h),
                  "midlayer.self_attn.o_proj.weight": (h, h), "midlayer.mlp.gate_proj.weight": (inter, h),
                  "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter)}
        t.update({k: torch.randn(shape, generator=gen) * 0.05 for k, shape in shapes.items()})
        t["lm_head.weight"] = torch.randn(rows.shape, generator=gen) * 0.05
    else:
        raise ValueError(f"kind must be 'self' or 'random', got {kind!r}")
    if draft_vocab is None:
        del t["lm_head.weight"]
    else:
        ids = torch.tensor(draft_vocab, dtype=torch.int64)
        t["d2t"] = ids - torch.arange(len(ids))
    dtype = getattr(torch, cfg.get("torch_dtype") or "float32")
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in t.items()},
              os.path.join(out_dir, "model.safetensors"))
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, num_key_value_heads=heads,
               head_dim=head_dim)
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = len(draft_vocab)
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


MTP_LAYER_NAMES = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                   "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def make_mimo_dir(out_dir: str, kind: str = "self", seed: int = 0, tokenizer_dir: str | None = None,
                  mtp_layers: int = 1, **config_overrides) -> str:
    """Write a tiny ``MiMoForCausalLM`` folder: a random Qwen2 body (one layer unless overridden, unit-RMS
    embeddings) plus ``mtp_layers`` MTP layers under the published names ``model.mtp_layers.{i}.*``.

    kind="self": every MTP layer mirrors the target, so its drafts are mostly accepted. ``input_proj`` = [0 | I]
    keeps the token half of cat(hidden, token) and drops the hidden half; ``token_layernorm`` = ones is the
    identity on unit-RMS embeddings; the decoder layer is a copy of the target's layer 0; ``final_layernorm`` is a
    copy of the target's final norm. At position i the MTP layer then runs the target's own layer on token i + 1
    with the target's RoPE (relative, so one position lower changes nothing) and attends over the MTP KV of
    tokens 2 .. i + 1 (position 0 holds the zeroed embedding), then applies the target's final norm: for a
    ONE-layer target this is the target's prediction after token i + 1 with only tokens 0 and 1 missing from the
    context, through the same LM head. kind="random": random MTP weights (drafts mostly rejected).
    """
    from safetensors.torch import load_file, save_file

    config_overrides.setdefault("num_hidden_layers", 1)
    make_model_dir(out_dir, "qwen2", seed=seed, tokenizer_dir=tokenizer_dir, unit_embeddings=True,
                   **config_overrides)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    dtype = tensors["model.norm.weight"].dtype
    h = tensors["model.norm.weight"].shape[0]
    gen = torch.Generator().manual_seed(seed + 1)
    for i in range(mtp_layers):
        p = f"model.mtp_layers.{i}."
        layer = {k.removeprefix("model.layers.0."): v for k, v in tensors.items() if k.startswith("model.layers.0.")}
        assert {k.rsplit(".", 1)[0] for k in layer} == set(MTP_LAYER_NAMES), sorted(layer)
        mtp = {"token_layernorm.weight": torch.ones(h), "hidden_layernorm.weight": torch.ones(h)}
        if kind == "self":
            mtp["input_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)  # [h, 2h]: token half
            mtp["final_layernorm.weight"] = tensors["model.norm.weight"].clone()
            mtp.update({k: v.clone() for k, v in layer.items()})
        elif kind == "random":  # norm weights away from 1, so mixing up the two input norms shows
            mtp["token_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=gen)
            mtp["hidden_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=gen)
            mtp["input_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.1
            mtp["final_layernorm.weight"] = tensors["model.norm.weight"].clone()
            mtp.update({k: (v.clone() if "layernorm" in k else torch.randn(v.shape, generator=gen) * 0.05)
                        for k, v in layer.items()})
        else:
            raise ValueError(f"kind must be 'self' or 'random', got {kind!r}")
        tensors.update({p + k: v.to(dtype).contiguous() for k, v in mtp.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=mtp_layers)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir
