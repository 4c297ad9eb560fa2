"""FR-Spec: draft over a hot subset of the target vocabulary (``--speculative-token-map PATH``).

The file is what SGLang reads: ``torch.save`` of a 1-D integer tensor of hot TARGET token ids (e.g. the 32768
most frequent ones). The draft's LM head keeps only those rows, so drafting scores ``Vh`` tokens instead of
``V``; the draft's top-k indices (positions in the hot list) are mapped back to target ids through the tensor.
Verification still uses the target's full LM head, so the output is unchanged (lossless); a token outside the
hot list can never be drafted, only produced as the bonus token.

Three parts:
- loading and validating a map (``load_token_map``), errors name ``--speculative-token-map``;
- building one from token frequencies over a corpus (``build_token_map``, ``specserve build-token-map``):
  the ``size`` ids with the highest counts, ties broken by the lower id; the target's EOS ids are always in
  the map (``include_eos``), because a draft that cannot propose EOS cannot draft the end of an answer;
- ``HotVocabHead``: the target LM head restricted to the hot rows, plugged into
  ``DraftModel.logits`` of the EAGLE-1/2, MTP and standalone drafts (returns ``(logits [R, Vh], hot ids [Vh])``).

Getting the hot rows without a second copy of the full LM head (``lm_head_rows``): a plain ``nn.Linear`` head is
indexed directly; a tied head is read through the (never packed) input embedding; an untied head that was
replaced by a oneDNN ``PackedLinear`` on CPU (which keeps no plain weight) is read back from the target's
safetensors, ``ROW_BLOCK`` rows at a time, so the extra memory is one block plus the hot rows.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence

import torch
from safetensors import safe_open
from torch import nn

from specserve.flags import ConfigError
from specserve.models.direct_call import DirectCall, Linear
from specserve.models.loader import read_config, resolve_model_path, safetensors_files
from specserve.platform import PlatformPolicy

logger = logging.getLogger(__name__)

FLAG = "--speculative-token-map"
ROW_BLOCK = 4096  # LM-head rows read from the checkpoint at a time
TEXT_BLOCK_CHARS = 1 << 16  # plain-text corpus files are tokenized in blocks of whole lines of about this size
ENCODE_BATCH = 32  # texts per tokenizer call


# ---------------------------------------------------------------------------------------------- loading
def resolve_token_map_path(path: str) -> str:
    """A local file as is; else ``owner/repo/file.pt`` looked up in the local Hugging Face cache (as SGLang's
    ``thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt``; we never download)."""
    if os.path.isfile(path):
        return path
    parts = path.split("/")
    if len(parts) >= 3 and not path.startswith((".", "/")):
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any hub failure means: not available offline
            raise ConfigError(
                f"{FLAG}: {path!r} is not a file and not in the local Hugging Face cache "
                f"(specserve does not download; fetch it first) ({type(e).__name__})"
            ) from e
    raise ConfigError(f"{FLAG}: {path!r} does not exist")


def validate_token_map(obj, vocab_size: int, min_size: int = 1, source: str = "the token map") -> torch.Tensor:
    """A loaded object -> hot target ids [Vh] int64 (CPU), or ConfigError naming the flag and the problem.

    Accepts a 1-D integer tensor (the format) or a list/tuple of ints (what SGLang's loader also accepts)."""
    if isinstance(obj, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in obj):
        obj = torch.tensor(obj, dtype=torch.int64)
    if not isinstance(obj, torch.Tensor):
        raise ConfigError(f"{FLAG}: {source} must hold a 1-D integer tensor of token ids, got {type(obj).__name__}")
    if obj.dtype.is_floating_point or obj.dtype.is_complex or obj.dtype == torch.bool:
        raise ConfigError(f"{FLAG}: {source} must hold integer token ids, got dtype {obj.dtype}")
    if obj.dim() != 1:
        raise ConfigError(f"{FLAG}: {source} must be a 1-D tensor of token ids, got shape {tuple(obj.shape)}")
    ids = obj.to(device="cpu", dtype=torch.int64)
    if ids.numel() == 0:
        raise ConfigError(f"{FLAG}: {source} is empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ConfigError(f"{FLAG}: {source} holds token id {bad}, outside the target vocabulary [0, {vocab_size})")
    uniq, counts = torch.unique(ids, return_counts=True)
    if uniq.numel() != ids.numel():
        raise ConfigError(f"{FLAG}: {source} repeats token id {int(uniq[counts > 1][0])}")
    if ids.numel() < min_size:
        raise ConfigError(
            f"{FLAG}: {source} has {ids.numel()} token ids, fewer than the {min_size} drafted per step "
            "(--speculative-eagle-topk)"
        )
    return ids


def load_token_map(path: str, vocab_size: int, min_size: int = 1) -> torch.Tensor:
    """``--speculative-token-map`` file -> validated hot target ids [Vh] int64 (CPU)."""
    file = resolve_token_map_path(path)
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        raise ConfigError(f"{FLAG}: cannot read {file!r} with torch.load: {e}") from e
    return validate_token_map(obj, vocab_size, min_size, source=repr(path))


def save_token_map(ids: torch.Tensor, path: str) -> None:
    """Write hot ids [Vh] in the format ``load_token_map`` reads (``torch.save`` of an int64 tensor)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(ids.to(device="cpu", dtype=torch.int64).contiguous(), path)


# ---------------------------------------------------------------------------------------------- the hot head
class HotVocabHead(DirectCall):
    """An LM head (the target's, for EAGLE) restricted to the hot rows: draft hidden [R, h] -> (logits [R, Vh]
    float32, hot ids [Vh] int64). Column j of the logits is the full head's logit of token ``hot_ids[j]``."""

    def __init__(self, weight: torch.Tensor, hot_ids: torch.Tensor) -> None:  # weight [Vh, h], hot_ids [Vh]
        super().__init__()
        self.proj = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.proj.weight = nn.Parameter(weight, requires_grad=False)  # no copy
        self.register_buffer("hot_ids", hot_ids.to(device=weight.device, dtype=torch.int64), persistent=False)

    @property
    def size(self) -> int:
        return self.hot_ids.numel()

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(hidden).float(), self.hot_ids

    @classmethod
    def for_target(cls, path: str, runner, min_size: int = 1, dtype: torch.dtype | None = None) -> HotVocabHead:
        """Load ``path`` against the target held by ``runner`` (a ModelRunner) and restrict the target's LM head
        (EAGLE-1/2 and MTP draft with it), as a copy in ``dtype`` (the draft's; default the target's), packed as
        the runner's platform packs weights."""
        return cls.for_model(path, runner.model, runner.model_dir, runner.spec, runner.device, dtype or runner.dtype,
                             min_size, platform=runner.platform)

    @classmethod
    def for_model(cls, path: str, model: nn.Module, model_dir: str, spec, device: torch.device, dtype: torch.dtype,
                  min_size: int = 1, platform: PlatformPolicy | None = None) -> HotVocabHead:
        """Restrict the LM head of any loaded CausalLM (e.g. a STANDALONE draft model: its own head) to the hot
        ids of ``path``, validated against ``spec.vocab_size``. platform: packs the head as it packs the models'
        weights (oneDNN on CPU unless ``--disable-cpu-weight-packing``); None: a plain Linear."""
        ids = load_token_map(path, spec.vocab_size, min_size)
        rows = lm_head_rows(model, model_dir, spec.tie_word_embeddings, ids)
        head = cls(rows.to(device=device, dtype=dtype), ids)
        if platform is not None:
            platform.pack_weights(head)
        logger.info("FR-Spec: draft LM head restricted to %d hot tokens of %d (%s)", head.size, spec.vocab_size, path)
        return head


def lm_head_rows(model: nn.Module, model_dir: str, tied: bool, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [Vh] of a loaded CausalLM's LM head weight -> [Vh, h], without copying the whole head."""
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    with torch.no_grad():
        if isinstance(weight, torch.Tensor) and getattr(model, "tp", None) is None:  # a plain, whole Linear
            return weight.index_select(0, ids.to(weight.device))
        if tied:  # the head is the input embedding, which packing leaves alone
            return model.embed(ids.to(next(model.parameters()).device))
    return read_checkpoint_rows(model_dir, "lm_head.weight", ids)


def read_checkpoint_rows(model_dir: str, name: str, ids: torch.Tensor, block: int = ROW_BLOCK) -> torch.Tensor:
    """Rows ``ids`` [Vh] of checkpoint tensor ``name`` [V, h] -> [Vh, h] (checkpoint dtype), read block-wise."""
    file = next((f for f in safetensors_files(model_dir) if _has_tensor(f, name)), None)
    if file is None:
        raise ConfigError(f"{FLAG}: the target checkpoint in {model_dir!r} has no {name} to take hot rows from")
    order = torch.argsort(ids)
    wanted = ids[order]  # [Vh] ascending
    parts = []
    with safe_open(file, framework="pt") as f:
        sl = f.get_slice(name)
        vocab = sl.get_shape()[0]
        for lo in range(0, vocab, block):
            sel = wanted[(wanted >= lo) & (wanted < lo + block)]
            if sel.numel():
                parts.append(sl[lo : lo + block].index_select(0, sel - lo))
    rows = torch.cat(parts)  # [Vh, h] in ascending id order
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _has_tensor(file: str, name: str) -> bool:
    with safe_open(file, framework="pt") as f:
        return name in f.keys()


# ---------------------------------------------------------------------------------------------- building
def count_token_ids(id_lists: Iterable[Sequence[int]], vocab_size: int, counts: torch.Tensor | None = None):
    """Occurrences of each id over token-id sequences -> counts [vocab_size] int64 (added to ``counts``)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64) if counts is None else counts
    for ids in id_lists:
        if len(ids):
            t = torch.as_tensor(ids, dtype=torch.int64)
            if int(t.min()) < 0 or int(t.max()) >= vocab_size:
                raise ValueError(f"token id {int(t.max())} is outside the target vocabulary [0, {vocab_size})")
            counts += torch.bincount(t, minlength=vocab_size)
    return counts


def select_hot_ids(counts: torch.Tensor, size: int, always_include: Iterable[int] = ()) -> torch.Tensor:
    """counts [V] -> the ``size`` hot ids [size] int64: ``always_include`` first, then by count (descending),
    ties broken by the lower id. Ids that never occurred fill the map last (lowest ids first)."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"--size must be in 1..{vocab} (the target vocabulary), got {size}")
    forced = torch.zeros(vocab, dtype=torch.bool)
    forced[torch.tensor(sorted(set(always_include)), dtype=torch.int64)] = True
    if int(forced.sum()) > size:
        raise ValueError(f"--size {size} is smaller than the {int(forced.sum())} ids that must be included")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts stay id-ascending
    order = torch.cat([order[forced[order]], order[~forced[order]]])
    return order[:size].clone()


def corpus_texts(path: str, tokenizer) -> Iterator[str]:
    """Texts of one corpus file: ``.jsonl`` -> one text per line (chat ``messages`` / ShareGPT ``conversations``
    rendered with the tokenizer's chat template, or a ``text`` field); anything else -> plain text in blocks of
    whole lines."""
    if path.endswith(".jsonl"):
        yield from _jsonl_texts(path, tokenizer)
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        block: list[str] = []
        size = 0
        for line in f:
            block.append(line)
            size += len(line)
            if size >= TEXT_BLOCK_CHARS:
                yield "".join(block)
                block, size = [], 0
        if block:
            yield "".join(block)


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _jsonl_texts(path: str, tokenizer) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "messages" in record:
                messages = record["messages"]
            elif "conversations" in record:
                messages = [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]}
                            for m in record["conversations"]]
            elif "text" in record:
                yield record["text"]
                continue
            else:
                raise ValueError(f"{path}:{n}: expected a 'messages', 'conversations' or 'text' field")
            yield tokenizer.apply_chat_template(messages, tokenize=False)


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def count_corpus(files: Sequence[str], tokenizer, vocab_size: int, progress: bool = True) -> torch.Tensor:
    """Token counts [vocab_size] over corpus files, tokenized with the target's tokenizer (no BOS/EOS added)."""
    from tqdm import tqdm

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in tqdm(files, desc="Counting tokens", unit="file", disable=not progress):
        for texts in _batched(corpus_texts(path, tokenizer), ENCODE_BATCH):
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            count_token_ids(ids, vocab_size, counts)
    return counts


def target_vocab_and_eos(model_dir: str, tokenizer) -> tuple[int, list[int]]:
    """(target vocabulary size, EOS ids from config.json, generation_config.json and the tokenizer)."""
    cfg = read_config(model_dir)
    cfg = cfg.get("text_config", cfg) if "vocab_size" not in cfg else cfg
    vocab = cfg.get("vocab_size") or len(tokenizer)
    eos = set(_as_ids(cfg.get("eos_token_id")))
    gen_cfg = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_cfg):
        with open(gen_cfg) as f:
            eos.update(_as_ids(json.load(f).get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return vocab, sorted(i for i in eos if 0 <= i < vocab)


def _as_ids(x) -> list[int]:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def build_token_map(model_path: str, corpus_files: Sequence[str], size: int, include_eos: bool = True,
                    tokenizer_path: str | None = None, progress: bool = True) -> torch.Tensor:
    """The ``size`` most frequent target token ids over ``corpus_files`` -> [size] int64 (see ``select_hot_ids``).

    Only the target's config and tokenizer are read (no weights)."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_dir)
    vocab, eos = target_vocab_and_eos(model_dir, tokenizer)
    counts = count_corpus(corpus_files, tokenizer, vocab, progress)
    seen = int((counts > 0).sum())
    if seen < size:
        logger.warning("the corpus has %d distinct token ids, fewer than --size %d: the rest are unseen ids", seen,
                       size)
    return select_hot_ids(counts, size, eos if include_eos else ())
