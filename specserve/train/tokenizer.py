"""Training a byte-level BPE tokenizer (HF ``tokenizers``) with a chat template, saved as an HF tokenizer folder."""

from __future__ import annotations

import os
from collections.abc import Iterable

# A chat turn is <|role|>content<|end|>. With tools, a system turn lists them first, and tool calls are written in the
# <tool_call> JSON format of Qwen2.5 / Hermes (specserve/tools/formats.py: the server's "qwen25" parser reads them);
# a tool's result comes back in a user turn, inside <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You can call these functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "To call one, answer with <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n"
    "</tool_call><|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n</tool_response><|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str, progress: bool = False):
    """Train byte-level BPE on texts; save tokenizer.json + tokenizer_config.json (with the chat template) into
    out_dir; -> the transformers fast tokenizer. Ids 0..6 are the special tokens (BOS 0, EOS 1, pad 6)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
