"""Qwen3: the Llama network with an RMSNorm over each head of q and k before RoPE (bias per config)."""

from specserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
