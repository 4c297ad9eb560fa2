"""The frozen target's outputs over a training set, computed once: what a head trainer reads instead of running
the target at every step.

A head trains for many passes over the same tokens; on a CPU the target's forward costs far more than the head's
step (SmolLM2-135M: ~5 s for 4k tokens against a fraction of that for a one-layer head). The cache holds, per
token of the packed training stream:

    tokens      [N]          int32     the conversations one after another
    aux         [N, 3h]      bf16      the captured residual streams (EAGLE-3's input; none without capture layers)
    feats       [N, h]       bf16      the post-norm hidden (EAGLE-1/2's input and feature target)
    top_ids     [N, k]       int32     the target's k most likely next tokens
    top_logits  [N, k]       float32   their logits (a soft label kept to its top k)
    mask        [N]          bool      optional: whether a row's label (the token after it) is one a head learns
                                       to predict (``label_mask`` of ``answer_mask``: the assistant's turns of a
                                       chat); None: every row

Each conversation is run alone (right-padded in a batch of similar lengths), so its features are the ones serving
computes: its context starts at its own first token.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.attention.training import train_batch
from specserve.train.corpus import sample_windows

TOP_K = 16


@dataclass
class TopK:
    """A soft label kept to its k most likely ids: ids [..., k] (-1: not in the vocabulary trained on), logits."""

    ids: torch.Tensor
    logits: torch.Tensor

    def shifted(self, k: int, seq: int) -> TopK:
        """Row i gets the label of row i + 1 + k ([B, L+1, k] -> [B*seq, k]); rows past the end wrap (masked)."""
        return TopK(*(torch.cat([t[:, 1 + k :], t[:, :k]], dim=1)[:, :seq].reshape(-1, t.shape[-1])
                      for t in (self.ids, self.logits)))

    def mapped(self, index: torch.Tensor | None) -> TopK:
        """Ids through a target -> trained-vocabulary index [V] (-1 = absent); None: unchanged."""
        return self if index is None else TopK(index[self.ids.long()], self.logits)


def topk_cross_entropy(logits: torch.Tensor, label: TopK, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked rows of CE(softmax over the label's present ids, softmax(logits)): logits [R, V], label
    [R, k], mask [R] bool. A row none of whose ids is present counts as 0."""
    present = label.ids >= 0
    p = label.logits.float().masked_fill(~present, float("-inf")).softmax(-1).nan_to_num(0.0)  # [R, k]
    logp = logits.float().log_softmax(-1).gather(-1, label.ids.long().clamp_min(0))  # [R, k]
    loss = -(p * logp).sum(-1)
    return (loss * mask).sum() / mask.sum().clamp_min(1)


def answer_mask(tokens: torch.Tensor, open_ids: list[int], close_id: int) -> torch.Tensor:
    """tokens [N] -> bool [N]: True from the token after each occurrence of the sequence open_ids (a chat template's
    assistant header) up to and including the next close_id (its end of turn)."""
    n, m = tokens.numel(), len(open_ids)
    if n < m:
        return torch.zeros(n, dtype=torch.bool)
    win = tokens.unfold(0, m, 1)  # [N-m+1, m]
    starts = (win == torch.tensor(open_ids, dtype=tokens.dtype)).all(-1).nonzero().flatten() + m
    ends = (tokens == close_id).nonzero().flatten()
    delta = torch.zeros(n + 1, dtype=torch.int32)
    for s in starts.tolist():
        after = ends[ends >= s]
        e = after[0].item() + 1 if after.numel() else n
        delta[s] += 1
        delta[e] -= 1
    return delta.cumsum(0)[:n] > 0


def label_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """[N] bool over tokens -> [N] bool over rows: row p is kept when token p + 1 is (the last row: never)."""
    return torch.cat([token_mask[1:], token_mask.new_zeros(1)])


class FeatureStream(ABC):
    """A packed token stream with per-token tensors, sampled in windows; rows(name, idx) reads the tensors."""

    tokens: torch.Tensor
    mask: torch.Tensor | None

    def __len__(self) -> int:
        return self.tokens.numel()

    def window(self, batch_size: int, seq_len: int, seed: int, step: int):
        """A training step's random windows (a pure function of seed and step): x [B, L+1] int64, the labels TopK
        [B, L+1, k], feats [B, L+1, h], aux [B, L, 3h], mask [B, L+1] bool (None without a mask)."""
        idx = sample_windows(torch.arange(len(self)), batch_size, seq_len, seed, step)  # [B, L+1]
        top = TopK(self.rows("top_ids", idx), self.rows("top_logits", idx))
        mask = None if self.mask is None else self.mask[idx]
        return self.tokens[idx].long(), top, self.rows("feats", idx), self.rows("aux", idx[:, :-1]), mask

    @abstractmethod
    def rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx [...] of one per-token tensor ("aux", "feats", "top_ids", "top_logits") -> [..., *row shape]."""


@dataclass
class FeatureCache(FeatureStream):
    tokens: torch.Tensor
    aux: torch.Tensor
    feats: torch.Tensor
    top: TopK
    mask: torch.Tensor | None = None

    def rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        return self.tensor(name)[idx]

    def tensor(self, name: str) -> torch.Tensor:
        return getattr(self.top, name[len("top_"):]) if name.startswith("top_") else getattr(self, name)

    def save(self, path: str) -> None:
        torch.save({"tokens": self.tokens, "aux": self.aux, "feats": self.feats, "top_ids": self.top.ids,
                    "top_logits": self.top.logits}, path)

    @classmethod
    def concat(cls, caches: list[FeatureCache]) -> FeatureCache | FeatureShards:
        """The caches' streams one after another, each read in place (one cache: itself)."""
        return caches[0] if len(caches) == 1 else FeatureShards(caches)

    @classmethod
    def load(cls, path: str, mmap: bool = False) -> FeatureCache:
        """A saved cache; with mmap its tensors stay in the file (paged in as windows read them), so caches larger
        than the memory left can be trained on. The file is then read ahead into the page cache in the background
        (a window read from disk took about 0.2 s, from memory 10-20 ms)."""
        if mmap and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        d = torch.load(path, weights_only=True, mmap=mmap)
        return cls(d["tokens"], d["aux"], d["feats"], TopK(d["top_ids"], d["top_logits"]))


def gather_rows(parts: list[torch.Tensor], starts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx [...] of the row-wise concatenation of parts, without concatenating them: parts[s] holds rows
    starts[s] .. starts[s + 1] - 1 (starts [S] int64, starts[0] = 0) -> [..., *row shape]."""
    shard = torch.searchsorted(starts, idx.contiguous(), right=True) - 1  # [...] which part each row is in
    out = parts[0].new_empty((*idx.shape, *parts[0].shape[1:]))
    for s, part in enumerate(parts):
        here = shard == s
        if here.any():
            out[here] = part[idx[here] - starts[s]]
    return out


class FeatureShards(FeatureStream):
    """Several caches read as one stream, each in place: concatenating SmolLM2's six feature shards (2.6 GB each)
    would hold a second copy of all of them in memory. tokens and mask (small) are concatenated; the windows are
    the ones the concatenated cache would give for the same seed and step."""

    def __init__(self, parts: list[FeatureCache]) -> None:
        self.parts = parts
        masks = [c.mask for c in parts]
        lengths = torch.tensor([len(c) for c in parts])
        self.starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])  # [S]
        self.tokens = torch.cat([c.tokens for c in parts])
        self.mask = None if any(m is None for m in masks) else torch.cat(masks)

    def rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        return gather_rows([c.tensor(name) for c in self.parts], self.starts, idx)


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped by similar length, each group at most max_tokens once padded (a sequence
    longer than max_tokens alone in its group); groups in the original order of their first member."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and lengths[i] * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return sorted(groups, key=lambda g: min(g))


@torch.no_grad()
def build_feature_cache(target, sequences: list[list[int]], capture: tuple[int, ...], top_k: int = TOP_K,
                        max_tokens: int = 4096, pad_id: int = 0, bf16: bool = True,
                        progress: bool = True) -> FeatureCache:
    """Run the target once over each sequence (bf16 autocast when bf16); -> the cache of the sequences packed in
    their given order."""
    from tqdm import tqdm

    device = next(target.parameters()).device
    lengths = [len(s) for s in sequences]
    total = sum(lengths)
    h = target.spec.hidden_size
    aux = torch.empty(total, h * len(capture), dtype=torch.bfloat16)
    feats = torch.empty(total, h, dtype=torch.bfloat16)
    top_ids = torch.empty(total, top_k, dtype=torch.int32)
    top_logits = torch.empty(total, top_k, dtype=torch.float32)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    bar = tqdm(total=total, desc="Target features", unit="tok", unit_scale=True, disable=not progress)
    for group in length_batches(lengths, max_tokens):
        width = max(lengths[i] for i in group)
        x = torch.full((len(group), width), pad_id, dtype=torch.long)
        for row, i in enumerate(group):
            x[row, : lengths[i]] = torch.tensor(sequences[i])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = target(train_batch(x.to(device), capture_layers=capture))
        logits = out.logits.view(len(group), width, -1)
        lv, li = logits.float().topk(top_k, dim=-1)  # [G, W, k]
        hid = out.hidden.view(len(group), width, -1)
        cap = (torch.cat(out.aux_hidden, -1) if capture else hid.new_empty(len(group) * width, 0)).view(
            len(group), width, -1)
        for row, i in enumerate(group):
            a, n = offsets[i], lengths[i]
            aux[a : a + n], feats[a : a + n] = cap[row, :n].cpu(), hid[row, :n].cpu()
            top_ids[a : a + n], top_logits[a : a + n] = li[row, :n].cpu(), lv[row, :n].cpu()
        bar.update(sum(lengths[i] for i in group))
    bar.close()
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    return FeatureCache(tokens, aux, feats, TopK(top_ids, top_logits))
