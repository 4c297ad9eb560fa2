"""Draft networks of the tree drafter (``EagleProposer``): which network drafts, as one object per variant.

``EagleProposer`` owns the tree machinery (the draft levels, the per-request ``DraftState``, scoring, the draft KV
pool and its scratch slots); a ``DraftModel`` owns everything that depends on the network:

- loading and checking it (``--speculative-draft-model-path``, the variant's model ``registry``, the dtype the
  platform policy chooses, already resolved by ``memory_cost``; the platform's weight packing and mixed-precision
  linears), and the FR-Spec hot LM head (``--speculative-token-map``) where the variant scores with a full vocabulary;
- its KV layer count, KV dtype and memory cost (``kv_layers``, ``pool_dtype``, ``memory_cost``: class methods,
  called before anything is loaded);
- its forward (tokens + target hidden -> draft hidden), its draft logits and the draft id -> target id map
  (``logits``), which target hidden states it reads (``target_hidden``, ``capture_layers``);
- its catch-up: the draft position of the root (``root_offset``), what one draft extend covers after a prefill or a
  verify step (``prefill_catch_up`` / ``verify_catch_up`` -> ``CatchUp``) and whether the root's draft KV needs a
  slot the drafter holds until the next step (``holds_root_slot``).

The variants:
- ``EagleHeadDraft``: an EAGLE-1/2 head (``heads/eagle.py``) fed the target's final hidden state, scored with the
  target's LM head (or the hot rows of it). The EAGLE shift: the draft's KV at position i comes from the target's
  hidden state at i and the token at i + 1;
- ``Eagle3HeadDraft``: an EAGLE-3 head (``heads/eagle3.py``) reading the concatenated residual stream the target
  captures at three layers, with its own final norm and an LM head over a draft vocabulary mapped to target ids by
  ``d2t``;
- ``MtpDraft``: the target's own first multi-token-prediction layer (MiMo), part of the target's checkpoint and
  dtype; inputs as an EAGLE head's, output through the target's LM head;
- ``StandaloneDraft``: a smaller causal LM with the target's tokenizer and its own KV per layer. It sees every token
  at its own position (``root_offset = 1``): a catch-up extend covers the newly committed positions and the new
  root, whose draft KV goes to a slot held until the next step (the target has no slot for the root yet).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.attention import ForwardBatch
from specserve.cache.kv_pool import KVPool
from specserve.flags import ConfigError
from specserve.models.loader import DTYPE_NAMES, count_parameters, dtype_name, load_model, model_spec, read_config
from specserve.models.registry import MODEL_REGISTRY
from specserve.platform import PlatformPolicy
from specserve.speculative.base import DraftMemory, PrefillChunk, VerifiedStep
from specserve.speculative.heads.eagle import EAGLE_HEADS
from specserve.speculative.heads.eagle3 import Eagle3Head
from specserve.speculative.token_map import HotVocabHead

logger = logging.getLogger(__name__)


@dataclass
class CatchUp:
    """One draft extend: request b's positions [starts[b], starts[b] + len(tokens[b])) with those input tokens and
    target hidden rows ``hidden`` (concatenated [T, h], or None for a drafter that reads none); the requests where
    ``seeded[b]`` get a new DraftState from the extend's last position. may_split: attend request by request where
    padding would waste (prompt catch-ups)."""

    reqs: list
    starts: list[int]
    tokens: list[list[int]]
    hidden: torch.Tensor | None
    seeded: list[bool]
    may_split: bool = False


class DraftModel:
    """A draft network loaded for one target runner. This base class loads a separate checkpoint from
    ``--speculative-draft-model-path`` through ``registry`` and catches up with the EAGLE shift; the variants below
    change what differs."""

    #: architectures a draft checkpoint may have (``load_model``'s registry)
    registry: dict = EAGLE_HEADS
    #: draft position of the root: EAGLE's shift puts the token at position i + 1 into draft position i, so the
    #: draft tree's level j sits at position root_pos + j - 1; a plain LM drafter uses offset 1
    root_offset: int = 0
    #: the root's draft KV goes to a slot the drafter holds between steps (a drafter that sees the root itself)
    holds_root_slot: bool = False
    #: the draft may keep its KV in another dtype and run its large forwards in it, where the platform says so
    #: (``PlatformPolicy.draft_kv_dtype``: on CPU a float32 draft with MixedLinears, in bf16)
    half_precision_calls: bool = True
    #: residual-stream layers the target must capture in prefill and verify forwards for ``target_hidden``
    capture_layers: tuple[int, ...] = ()
    #: the draft's top-k ids map to target ids injectively (the target's own vocabulary, or a token map with no
    #: repeats), so the children of a drafted node carry distinct tokens and select() need not merge duplicates
    distinct_ids: bool = True
    #: [Vd] target id of each draft id of the variant's own LM head; None: no such map (see ``logits``)
    d2t_ids: torch.Tensor | None = None
    #: the network is one layer, so a catch-up extend needs that layer's output at its requests' last rows only: the
    #: other rows write their K/V and stop there (``ForwardBatch.out_rows``); a deeper network needs every row's
    #: output for the next layer's K/V
    one_layer: bool = False

    def __init__(self, args, runner, topk: int) -> None:
        self.args, self.runner, self.target = args, runner, runner.model
        self.device, self.platform = runner.device, runner.platform
        self.dir: str | None = None  # the draft checkpoint's folder (None: none of its own)
        self.module, self.spec = self._load(args)  # sets self.dtype (and self.dir)
        # FR-Spec: draft over the hot token ids only (config.py drops the flag for EAGLE3)
        self.hot_head = self._make_hot_head(args.speculative_token_map, topk) if args.speculative_token_map else None
        self.kv_dtype = self.pool_dtype(self.platform, self.dtype, runner.dtype)
        self.half_dtype = None  # the dtype of large forwards when it is not the draft's (EagleProposer.compute_dtype)
        if self.platform.mixed_linears(self.dtype, runner.dtype):
            for module in (self.module, self.hot_head):
                if module is not None:
                    self.platform.mix_linears(module)
            all_mixed = not any(isinstance(m, torch.nn.Linear) for m in self.module.modules())
            if self.kv_dtype != self.dtype and all_mixed:  # every matmul has its packed bf16 copy
                self.half_dtype = self.kv_dtype

    # ------------------------------------------------------------------ sizing (before anything is loaded)
    @classmethod
    def kv_layers(cls, draft_spec) -> int:
        """Attention layers of the draft's KV pool (a draft model of this spec)."""
        return 1  # EAGLE heads have one attention layer

    @classmethod
    def pool_dtype(cls, platform: PlatformPolicy, draft_dtype: torch.dtype, target_dtype: torch.dtype) -> torch.dtype:
        """The draft KV's dtype: the platform's where this draft's large calls may run in it (on CPU, bf16 for a
        float32 draft with MixedLinears), else the draft's own."""
        if cls.half_precision_calls:
            return platform.draft_kv_dtype(draft_dtype, target_dtype)
        return draft_dtype

    @classmethod
    def memory_cost(cls, args, target_spec, target_dtype: torch.dtype, platform: PlatformPolicy) -> DraftMemory:
        """The draft model's weights and KV pool, from its config and the dtype it will run in, which it is then
        loaded in: ``--speculative-draft-dtype``, or for auto the platform's choice (``PlatformPolicy.draft_dtype``).
        A float32 draft's MixedLinears also hold bf16 copies: counted as 2 bytes per parameter more (an upper
        bound)."""
        path, revision = args.speculative_draft_model_path, args.speculative_draft_model_revision
        params = count_parameters(path, revision, cls.registry)
        flag = args.speculative_draft_dtype
        dtype = platform.draft_dtype(target_dtype, params) if flag == "auto" else DTYPE_NAMES[flag]
        spec = model_spec(path, revision, cls.registry)
        bf16_copies = 2 * params if platform.mixed_linears(dtype, target_dtype) else 0
        kv_dtype = cls.pool_dtype(platform, dtype, target_dtype)
        return DraftMemory(params * dtype.itemsize + bf16_copies,
                           KVPool.bytes_per_token(cls.kv_layers(spec), spec.num_kv_heads, spec.head_dim, kv_dtype),
                           dtype)

    # ------------------------------------------------------------------ loading
    def _load(self, args):
        """-> (network, its ModelSpec), loaded from --speculative-draft-model-path in the dtype ``memory_cost``
        resolved (``runner.draft_memory.dtype``), checked against the target and packed for the platform."""
        if not args.speculative_draft_model_path:
            raise ConfigError("--speculative-draft-model-path is required with --speculative-algorithm EAGLE")
        path, revision = args.speculative_draft_model_path, args.speculative_draft_model_revision
        self.dtype = self.runner.draft_memory.dtype  # resolved once, by memory_cost, for the KV capacity
        module, spec, self.dir = load_model(
            path, dtype_name(self.dtype), self.device, revision, registry=self.registry,
            load_format=args.load_format, seed=args.random_seed + 1,
        )
        if self.dtype != self.runner.dtype:
            logger.info("draft model runs in %s (target: %s)", dtype_name(self.dtype), dtype_name(self.runner.dtype))
        self._check(module, spec)
        self.platform.pack_weights(module)
        return module, spec

    def _check(self, module, spec) -> None:
        if spec.hidden_size != self.runner.spec.hidden_size:
            raise ConfigError(
                f"--speculative-draft-model-path: the draft head's hidden_size {spec.hidden_size} does not fit the "
                f"target's hidden_size {self.runner.spec.hidden_size}"
            )

    def _make_hot_head(self, path: str, topk: int) -> HotVocabHead:
        """FR-Spec: the LM head the drafts are scored with, restricted to the hot ids (here: the target's)."""
        return HotVocabHead.for_target(path, self.runner, topk, dtype=self.dtype)

    def draft_modules(self) -> list:
        """The networks whose ``forward(fb, *tensors)`` may be compiled and graphed."""
        return [self.module]

    # ------------------------------------------------------------------ the network
    def forward(self, fb: ForwardBatch, hidden: torch.Tensor | None,
                compute_dtype: Callable[[int], torch.dtype]) -> torch.Tensor:
        """One draft forward: tokens fb.input_ids [T] + hidden [T, h] -> draft hidden [T, h] (draft dtype);
        compute_dtype(T): the dtype the call runs in."""
        embeds = _as(self.target.embed(fb.input_ids), compute_dtype(fb.input_ids.shape[0]))
        return _as(self.module(fb, embeds, hidden), self.dtype)

    def topk(self, draft_hidden: torch.Tensor, k: int, scale: float, race: tuple | None = None,
             allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """softmax(logits * scale).topk(k) of draft hidden [R, h] in one call where the draft has one, or with race =
        (noise [G, Vd], inv_temps [G], rows per group) of softmax(logits * inv_temps - noise) per group of rows;
        allowed [R, W] int32: a grammar's bitmask rows over the target vocabulary (the tokens they do not allow never
        ranked) -> (probabilities [R, k] float32, TARGET ids [R, k] int64); None: rank ``logits`` (the default)."""
        return None

    #: the levels after the root's children in one call where the draft has that (``Eagle3HeadDraft.levels``)
    levels = None

    def vocab_ids(self, draft_hidden: torch.Tensor) -> torch.Tensor | None:
        """The target ids of ``topk``'s columns [Vd] (what a race's noise is drawn for) where ``topk`` takes these
        rows; None where it does not (the default: never)."""
        return None

    def logits(self, draft_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """draft hidden [R, h] -> (draft logits [R, Vd] float32, draft id -> target id map [Vd] or None when the
        draft vocabulary is the target's). EAGLE-1/2: the target's LM head, no final norm."""
        if self.hot_head is not None:
            return self.hot_head(draft_hidden)
        return self.target.compute_logits(draft_hidden.to(self.runner.dtype)), None

    def target_hidden(self, out, rows: torch.Tensor) -> torch.Tensor | None:
        """The target hidden states the network consumes, at flattened forward rows [R] -> [R, h]."""
        return out.hidden.index_select(0, rows)

    # ------------------------------------------------------------------ catching up
    def prefill_catch_up(self, chunks: list[PrefillChunk], out) -> CatchUp:
        """The extend after a prefill forward (EAGLE shift: position i with the token at i + 1); completed prompts
        get their first DraftState."""
        tokens = [c.req.fill_ids[c.start + 1 : c.start + c.length + 1] for c in chunks]
        rows = torch.cat([torch.arange(c.row_offset, c.row_offset + c.length) for c in chunks]).to(self.device)
        return CatchUp([c.req for c in chunks], [c.start for c in chunks], tokens, self.target_hidden(out, rows),
                       [c.completed for c in chunks], may_split=True)

    def verify_catch_up(self, steps: list[VerifiedStep], out) -> CatchUp:
        """The extend after a verify step: the accepted tokens with the target's hidden states at the accepted
        nodes (the draft-tree KV written while drafting is scratch and is dropped)."""
        rows = torch.cat([
            torch.tensor(s.accepted_nodes[: len(s.new_tokens)]) + s.row_offset for s in steps
        ]).to(self.device)
        return CatchUp([s.req for s in steps], [s.root_pos for s in steps], [s.new_tokens for s in steps],
                       self.target_hidden(out, rows), [True] * len(steps))


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, without a dispatched no-op cast when it is already (a draft level makes several such calls)."""
    return x if x.dtype == dtype else x.to(dtype)


class EagleHeadDraft(DraftModel):
    """An EAGLE-1/2 head: everything as the base class does it."""

    one_layer = True


def eagle3_capture_layers(num_layers: int, aux_layer_ids: list[int] | None) -> tuple[int, ...]:
    """Target layers to capture (at their input; id == num_layers means the last layer's output). The config's
    ``eagle_aux_hidden_state_layer_ids`` are layer OUTPUTS (= inputs of id + 1); by default the inputs of layers
    [2, L // 2, L - 3] (SGLang's choice), clamped into the target's 0..L range."""
    if aux_layer_ids is not None:
        wanted = [i + 1 for i in aux_layer_ids]
    else:
        wanted = [2, num_layers // 2, num_layers - 3]
    clamped = tuple(min(max(i, 0), num_layers) for i in wanted)
    if clamped != tuple(wanted):
        logger.warning("EAGLE-3 capture layers %s clamped to %s for a %d-layer target", wanted, clamped, num_layers)
    return clamped


class Eagle3HeadDraft(DraftModel):
    """An EAGLE-3 head: reads the target's residual stream captured at three layers (their concatenation [T, 3h],
    through its ``fc``); its own final norm and LM head over a draft vocabulary, whose ids map to target ids with
    ``d2t``."""

    one_layer = True

    registry = {"LlamaForCausalLMEagle3": Eagle3Head}

    def __init__(self, args, runner, topk: int) -> None:
        super().__init__(args, runner, topk)
        self.capture_layers = eagle3_capture_layers(runner.spec.num_layers, self.module.aux_layer_ids())
        head_vocab = self.module.draft_vocab_size
        self._columns: torch.Tensor | None = None  # ``vocab_ids`` without a d2t map
        self.d2t_ids = None  # [Vd] target id of each draft id; None = the identity (no gather per draft level)
        if head_vocab:
            ids = torch.arange(head_vocab, device=self.device) + self.module.d2t  # [Vd] target ids
            if int(ids.max()) >= runner.spec.vocab_size or int(ids.min()) < 0:
                raise ConfigError(
                    "--speculative-draft-model-path: the EAGLE-3 head's d2t maps draft ids outside the target "
                    f"vocabulary of {runner.spec.vocab_size}"
                )
            if bool(self.module.d2t.any()):  # an all-zero d2t: the target's vocabulary in the target's order
                self.d2t_ids = ids
            # a d2t sending two draft ids to one target id would give a node two children with one token: merged
            self.distinct_ids = int(torch.unique(ids).numel()) == ids.numel()
        logger.info("EAGLE-3 head: capture layers %s, draft vocabulary %s", self.capture_layers,
                    head_vocab or "= target's")

    def _check(self, module, spec) -> None:
        if module.target_hidden_size != self.runner.spec.hidden_size:
            raise ConfigError(
                f"--speculative-draft-model-path: the EAGLE-3 head expects target_hidden_size "
                f"{module.target_hidden_size}, the target has {self.runner.spec.hidden_size}"
            )

    def target_hidden(self, out, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat(out.aux_hidden, dim=-1).index_select(0, rows)  # [R, 3h]

    def logits(self, draft_hidden: torch.Tensor):
        normed = self.module.norm(draft_hidden)
        if self.module.lm_head is None:
            return self.target.compute_logits(normed.to(self.runner.dtype)), None
        return self.module.lm_head(normed).float(), self.d2t_ids

    def topk(self, draft_hidden: torch.Tensor, k: int, scale: float, race: tuple | None = None,
             allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The host's one-call ranking (``PlatformPolicy.head_ranker``) of ``logits`` (see ``DraftModel.topk``); None
        where it does not take the call."""
        if self.ranker is None:
            return None
        return self.ranker(draft_hidden, k, scale, self.d2t_ids, race, allowed)

    def vocab_ids(self, draft_hidden: torch.Tensor) -> torch.Tensor | None:
        if self.ranker is None or not self.ranker.fits(draft_hidden):
            return None
        return self.ranked_ids()

    def ranked_ids(self) -> torch.Tensor:
        """The target ids of the ranking's columns [Vd] (it exists: ``ranker``)."""
        if self.d2t_ids is not None:
            return self.d2t_ids
        if self._columns is None:
            self._columns = torch.arange(self.ranker.vocab, device=self.device)
        return self._columns

    @functools.cached_property
    def levels(self):
        """Asked once, after loading, as ``ranker``: the host's draft levels in one call
        (``PlatformPolicy.head_levels``) where the head ranks in one call, its layer runs one operator and the target's
        embeddings are its own (not under TP); None elsewhere."""
        if self.ranker is None or getattr(self.target, "tp", None) is not None:
            return None
        embedding = getattr(getattr(self.target, "model", None), "embed_tokens", None)
        return self.platform.head_levels(self.module.midlayer.fused, self.ranker, embedding)

    @functools.cached_property
    def ranker(self):
        """Asked once, after loading (the LM head's kernel copy exists then): the head's norm and its own LM head, or
        the target's where it has none (not under tensor parallelism); None with an FR-Spec map or where the host has
        none."""
        lm_head = self.module.lm_head
        if lm_head is None and getattr(self.target, "tp", None) is None:
            lm_head = getattr(self.target, "lm_head", None)
        if lm_head is None or self.hot_head is not None:
            return None
        return self.platform.head_ranker(self.module.norm, lm_head)


class MtpDraft(DraftModel):
    """The target's own MTP layer (the first one; MiMo ships one). It consumes an EAGLE head's inputs (the target's
    post-norm hidden state at position i and the token at i + 1, KV in a one-layer pool) and its output goes
    through the target's LM head; deeper levels re-apply the layer to its own output hidden, as SGLang does."""

    one_layer = True

    def _load(self, args):
        """The MTP layer is part of the TARGET's checkpoint and was loaded (and packed for CPU) with it."""
        layers = getattr(self.target, "mtp_layers", None)
        if not layers:
            raise ConfigError(
                f"--speculative-draft-model-path is required: the target ({self.runner.spec.architecture}) has no "
                "loaded MTP layers to draft with (num_nextn_predict_layers is 0 or its model.mtp_layers.* tensors "
                "are missing)"
            )
        if len(layers) > 1:
            logger.info("the target has %d MTP layers; drafting re-applies the first one", len(layers))
        self.dtype = self.runner.dtype
        if args.speculative_draft_dtype not in ("auto", dtype_name(self.dtype)):
            logger.warning("--speculative-draft-dtype %s is ignored with MTP: the MTP layer is part of the target "
                           "and runs in its dtype", args.speculative_draft_dtype)
        return layers[0], self.runner.spec

    @classmethod
    def memory_cost(cls, args, target_spec, target_dtype: torch.dtype, platform: PlatformPolicy) -> DraftMemory:
        """The MTP layer's weights are the target's (already counted); its KV pool has one layer of the target's
        shape, in the target's dtype."""
        return DraftMemory(0, KVPool.bytes_per_token(1, target_spec.num_kv_heads, target_spec.head_dim, target_dtype))

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor, compute_dtype) -> torch.Tensor:
        """Tokens fb.input_ids [T] + target (or previous MTP) hidden [T, h] -> MTP hidden [T, h], final-normed."""
        return self.module(fb, self.target.embed(fb.input_ids), hidden)


VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")  # any one defines a vocabulary


def check_same_tokenizer(target_dir: str, draft_dir: str, tokenizer_path: str | None, trust_remote_code: bool):
    """A standalone draft must tokenize exactly like the target: same token -> id map (special tokens included).

    A draft folder without tokenizer files (a draft shipped to go with one target, as SGLang's draft workers never
    load a tokenizer) is checked by its config instead: the same vocabulary size and BOS / EOS ids."""
    from transformers import AutoTokenizer

    if os.path.isdir(draft_dir) and not any(os.path.isfile(os.path.join(draft_dir, f)) for f in VOCAB_FILES):
        check_same_vocabulary(target_dir, draft_dir)
        return

    def vocab(path: str) -> dict[str, int]:
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code).get_vocab()
        except Exception as e:  # noqa: BLE001 - any loading failure is reported the same way
            raise ConfigError(f"--speculative-draft-model-path: cannot load the draft's tokenizer: {e}") from e

    target, draft = vocab(tokenizer_path or target_dir), vocab(draft_dir)
    if target != draft:
        differing = sum(1 for tok, i in target.items() if draft.get(tok) != i) + len(set(draft) - set(target))
        raise ConfigError(
            f"--speculative-draft-model-path: the draft's tokenizer differs from the target's ({differing} tokens "
            f"differ; vocabularies of {len(draft)} and {len(target)}); STANDALONE needs the same tokenizer"
        )


def check_same_vocabulary(target_dir: str, draft_dir: str) -> None:
    """The config-level check of a draft folder without a tokenizer: vocab_size, bos_token_id and eos_token_id equal
    the target's (an EOS list compares as a set)."""
    def ids(path: str) -> dict:
        cfg = read_config(path)
        eos = cfg.get("eos_token_id")
        return {"vocab_size": cfg.get("vocab_size"), "bos_token_id": cfg.get("bos_token_id"),
                "eos_token_id": sorted(eos) if isinstance(eos, list) else [eos]}

    target, draft = ids(target_dir), ids(draft_dir)
    differing = [k for k in target if target[k] != draft[k]]
    if differing:
        raise ConfigError(
            "--speculative-draft-model-path: the draft has no tokenizer files and its config differs from the "
            "target's in " + ", ".join(f"{k} ({draft[k]} vs {target[k]})" for k in differing)
            + "; STANDALONE needs the same tokenizer")
    logger.info("STANDALONE draft without tokenizer files: its vocabulary size and BOS / EOS ids match the target's")


class StandaloneDraft(DraftModel):
    """A smaller causal LM with the target's tokenizer, its own embedding, KV per layer and LM head; it reads no
    target hidden state.

    Unlike the EAGLE shift, it sees every token at its own position, the first token (BOS) included, as it was
    trained (SGLang instead feeds a standalone draft the EAGLE-shifted sequence, which hides the first token from
    it). The cost is one extra token of draft compute per step: its KV at position i holds token i, so a catch-up
    extend covers the newly committed positions AND the new root, whose KV goes to a held slot; the next extend
    recomputes the root at its committed slot and the held slot is freed."""

    registry = MODEL_REGISTRY
    root_offset = 1
    holds_root_slot = True
    half_precision_calls = False  # a full LM drafter keeps float32 throughout (its own embedding, per-layer KV)

    @classmethod
    def kv_layers(cls, draft_spec) -> int:
        return draft_spec.num_layers

    def _check(self, module, spec) -> None:
        target_vocab = self.runner.spec.vocab_size
        if spec.vocab_size != target_vocab:  # e.g. Qwen2.5 0.5B vs 7B: same tokenizer, padded differently
            logger.info("draft vocab_size %d != target's %d: drafts are limited to the shared ids",
                        spec.vocab_size, target_vocab)
        check_same_tokenizer(self.runner.model_dir, self.dir, self.args.tokenizer_path, self.args.trust_remote_code)

    def _make_hot_head(self, path: str, topk: int) -> HotVocabHead:
        return HotVocabHead.for_model(path, self.module, self.dir, self.spec, self.device, self.dtype,
                                      min_size=topk, platform=self.platform)

    def draft_modules(self) -> list:
        return [self.module.model]  # the decoder stack (forward(fb)); the LM head runs on the kept rows only

    def forward(self, fb: ForwardBatch, hidden, compute_dtype) -> torch.Tensor:
        return self.module.model(fb)[0]  # final (normed) hidden [T, h]; no logits for rows we do not sample

    def logits(self, draft_hidden: torch.Tensor):
        if self.hot_head is not None:
            return self.hot_head(draft_hidden)
        logits = self.module.compute_logits(draft_hidden)  # [R, Vd]
        return logits[:, : self.runner.spec.vocab_size], None

    def target_hidden(self, out, rows):
        return None

    def prefill_catch_up(self, chunks: list[PrefillChunk], out) -> CatchUp:
        """Each chunk's own positions, plus the root where the prompt completed."""
        tokens = [c.req.fill_ids[c.start : c.start + c.length + (1 if c.completed else 0)] for c in chunks]
        return CatchUp([c.req for c in chunks], [c.start for c in chunks], tokens, None,
                       [c.completed for c in chunks])

    def verify_catch_up(self, steps: list[VerifiedStep], out) -> CatchUp:
        """From the old root (recomputed at its committed slot) through the new root."""
        tokens = [s.req.fill_ids[s.root_pos : s.root_pos + len(s.new_tokens) + 1] for s in steps]
        return CatchUp([s.req for s in steps], [s.root_pos for s in steps], tokens, None, [True] * len(steps))
