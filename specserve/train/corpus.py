"""Training data: the demo corpus (the running interpreter's standard library), held-out prompts, token streams.

The demo family trains on the ``.py`` files of the interpreter's standard library (present on every machine,
no download). The modules in ``HELD_OUT`` are never trained on; ``held_out_prompts`` cuts evaluation prompts
from them. User data for the trainers is plain text (any extension) or JSONL chat/ShareGPT/``text`` records,
rendered with the target's chat template (``specserve.speculative.token_map.corpus_texts``).
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Sequence

import torch

# Standard-library modules kept out of every demo training set: the evaluation prompts come from these.
HELD_OUT = ("bisect.py", "colorsys.py", "fractions.py", "graphlib.py", "heapq.py", "shlex.py", "statistics.py",
            "textwrap.py", "json/")
HELD_OUT_KEYWORD = "held-out"  # `--prompts held-out` in eval-acceptance and the benchmarks


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _is_held_out(rel: str) -> bool:
    return any(rel == h or (h.endswith("/") and rel.startswith(h)) for h in HELD_OUT)


def stdlib_files(held_out: bool = False) -> list[str]:
    """Sorted .py files of the stdlib (no site-packages): the training part, or the held-out part."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                if _is_held_out(rel) == held_out:
                    out.append(os.path.join(dirpath, name))
    return sorted(out)


def read_text(path: str) -> str | None:
    """A source file's text, or None when it is not UTF-8 (a few stdlib test files are not)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        return None


DEF_LINE = re.compile(r"^[ \t]*def \w+\(.*\):[ \t]*(#.*)?$")


def held_out_prompts(n: int = 16, context_chars: int = 600) -> list[str]:
    """n code prompts from the held-out modules: up to context_chars of source ending with a ``def`` line whose
    signature fits one line (the model is asked to write the body). Deterministic, spread over all files."""
    candidates: list[str] = []
    for path in stdlib_files(held_out=True):
        text = read_text(path) or ""
        lines = text.splitlines(keepends=True)
        offset = 0
        for line in lines:
            offset += len(line)
            if DEF_LINE.match(line.rstrip("\n")):
                start = max(0, offset - context_chars)
                start = text.find("\n", start) + 1 if start else 0  # begin on a whole line
                candidates.append(text[start:offset].rstrip("\n"))  # end at the colon: the model writes the newline
    if not candidates:
        raise RuntimeError("no held-out prompts found in the standard library")
    step = max(1, len(candidates) // n)
    return candidates[::step][:n]


def tokenize_files(files: Sequence[str], tokenizer, eos_id: int, progress: bool = True) -> torch.Tensor:
    """One flat int32 token stream [N]: each file's (or JSONL record's) tokens followed by EOS."""
    from tqdm import tqdm

    from specserve.speculative.token_map import corpus_texts

    chunks: list[torch.Tensor] = []
    for path in tqdm(files, desc="Tokenizing", unit="file", disable=not progress):
        if path.endswith(".jsonl"):
            texts = list(corpus_texts(path, tokenizer))
        else:
            text = read_text(path)
            texts = [text] if text else []
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
            chunks.append(torch.tensor(ids, dtype=torch.int32))
    if not chunks:
        raise ValueError("the training data holds no text")
    return torch.cat(chunks)


def sample_windows(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """[batch_size, seq_len + 1] int64 random windows of the stream for training step `step` (a pure function of
    seed and step, so a resumed run sees the same batches)."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"the training data has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return tokens[idx].long()
