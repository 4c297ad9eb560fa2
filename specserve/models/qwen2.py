"""Qwen2: the Llama network with a bias on the q/k/v projections (none on o_proj)."""

from specserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
