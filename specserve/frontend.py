"""The request front end shared by the offline Engine and the HTTP server.

- ``RequestFactory`` turns a user's prompt/ids + sampling params into validated scheduler ``Req``s
  (tokenizing, checking ids and lengths, expanding ``n``, giving each request its own seeded generator).
- ``RequestState`` collects one request's outputs on the caller's side: detokenization happens here, off
  the model loop, except for requests with stop strings, whose text the scheduler already produced while
  checking for them (one source of truth for where the text is cut).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.sampling.detokenizer import IncrementalDetokenizer, StopChecker
from specserve.sampling.params import SamplingParams
from specserve.scheduler.req import Req, ReqOutput


class RequestError(ValueError):
    """An invalid request (bad prompt, ids, lengths or sampling params): HTTP 400 / ValueError."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}


def _param_of(message: str) -> str:
    """SamplingParams messages start with the field's name; others (unknown keys...) blame the dict."""
    first = message.split(" ")[0]
    return first if first in _PARAM_NAMES else "sampling_params"


@dataclass
class PreparedRequest:
    req: Req
    state: RequestState


class RequestFactory:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, eos_ids: set[int], random_seed: int,
                 device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.context_len = tokenizer, vocab_size, context_len
        self.eos_ids, self.random_seed, self.device = eos_ids, random_seed, device
        self._counter = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers", "input_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "input_ids")

    def params(self, raw: dict | SamplingParams | None, prompt_len: int) -> SamplingParams:
        try:
            p = raw if isinstance(raw, SamplingParams) else SamplingParams.from_dict(raw)
            p.normalize()
            room = self.context_len - prompt_len
            if room <= 0:
                raise RequestError(
                    f"the prompt has {prompt_len} tokens; the context length is {self.context_len}", "prompt")
            if p.max_new_tokens is None:
                p.max_new_tokens = room
            p.verify(self.vocab_size)
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e), _param_of(str(e))) from e
        if prompt_len + p.max_new_tokens > self.context_len:
            raise RequestError(
                f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds "
                f"the context length {self.context_len}", "max_new_tokens")
        return p

    def build(self, ids: list[int], params: SamplingParams, rid: str | None = None) -> list[PreparedRequest]:
        """One prepared request per sample (params.n of them; sample i gets seed + i)."""
        rid = rid or uuid.uuid4().hex
        out = []
        for i in range(params.n):
            sub_rid = rid if params.n == 1 else f"{rid}-{i}"
            sub = dataclasses.replace(params, n=1)
            sub.normalize()
            if params.seed is not None:
                sub.seed = params.seed + i
            req = Req(sub_rid, ids, sub, self._stop_ids(sub), self._generator(sub), self._stop_checker(sub))
            out.append(PreparedRequest(req, RequestState(sub_rid, len(ids), sub, self.tokenizer)))
        return out

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        ids = set(p.stop_token_ids or [])
        return ids if p.ignore_eos else ids | self.eos_ids

    def _generator(self, p: SamplingParams) -> torch.Generator | None:
        if p.is_greedy:
            return None
        seed = p.seed if p.seed is not None else self.random_seed * 1_000_003 + next(self._counter)
        return torch.Generator(device=self.device).manual_seed(seed)

    def _stop_checker(self, p: SamplingParams) -> StopChecker | None:
        return StopChecker(self.tokenizer, p) if p.stop_strs else None


@dataclass
class RequestState:
    """Caller-side view of one request: its output queue, text so far, and the result dicts."""

    rid: str
    prompt_tokens: int
    params: SamplingParams
    tokenizer: Any
    queue: Any = field(default_factory=queue.Queue)  # ReqOutput items (an asyncio.Queue for async callers)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished_reason: dict | None = None
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    cached_tokens: int = 0
    spec: dict = field(default_factory=dict)
    start: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        has_stops = bool(self.params.stop_strs)
        self._detok = None if has_stops else IncrementalDetokenizer(
            self.tokenizer, self.params.skip_special_tokens, self.params.spaces_between_special_tokens)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def apply_all(self, outs: list[ReqOutput]) -> None:
        """Fold many outputs in at once (non-streaming callers): one detokenizer call for all tokens."""
        if outs:
            self.apply(merge_outputs(outs))

    def apply(self, out: ReqOutput) -> dict:
        """Fold one scheduler output in; returns the incremental chunk (text/ids delta + meta)."""
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.top_logprobs.extend(out.new_top_logprobs)
        self.cached_tokens, self.spec = out.cached_tokens, out.spec
        if self._detok is not None:
            delta = self._detok.add(out.new_token_ids)
            if out.finished_reason is not None:
                delta += self._detok.flush()
        else:
            delta = out.new_text or ""
        self.text += delta
        self.finished_reason = out.finished_reason
        return self.chunk(delta, out.new_token_ids, len(out.new_logprobs))

    def meta_info(self) -> dict:
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
            "e2e_latency": time.monotonic() - self.start,
        }
        if self.params.return_logprob:
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in self.logprobs]
            if self.params.top_logprobs_num:
                meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in row] for row in self.top_logprobs]
        meta.update(self.spec)
        return meta

    def chunk(self, delta_text: str, delta_ids: list[int], n_new_logprobs: int) -> dict:
        meta = self.meta_info()
        if self.params.return_logprob:
            meta["output_token_logprobs"] = meta["output_token_logprobs"][len(self.logprobs) - n_new_logprobs:]
            if "output_top_logprobs" in meta:
                meta["output_top_logprobs"] = meta["output_top_logprobs"][len(self.logprobs) - n_new_logprobs:]
        return {"text": delta_text, "output_ids": list(delta_ids), "meta_info": meta}

    def result(self) -> dict:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info()}


def merge_outputs(outs: list[ReqOutput]) -> ReqOutput:
    """Consecutive outputs of one request as one (ids, logprobs and text deltas concatenated)."""
    last = outs[-1]
    texts = [o.new_text for o in outs]
    return dataclasses.replace(
        last,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_logprobs=[x for o in outs for x in o.new_logprobs],
        new_top_logprobs=[x for o in outs for x in o.new_top_logprobs],
        new_text=None if last.new_text is None else "".join(t or "" for t in texts),
    )


def prepare_requests(
    factory: RequestFactory,
    prompt: str | list[str] | None,
    sampling_params: dict | list[dict] | None,
    input_ids: list[int] | list[list[int]] | None,
    return_logprob: bool | None = None,
    top_logprobs_num: int | None = None,
    rid: str | list[str] | None = None,
) -> tuple[list[PreparedRequest], bool]:
    """The SGLang ``generate`` input (text or ids, single or batch, per-prompt or shared sampling params) as
    prepared requests, n samples of each prompt in a row. Returns (prepared, single): single is True when
    the caller gets one result dict (one prompt, n == 1) rather than a list. Shared by Engine and /generate.
    """
    if (prompt is None) == (input_ids is None):
        raise RequestError("give exactly one of prompt and input_ids", "prompt")
    batched = isinstance(prompt, list) if prompt is not None else bool(input_ids) and isinstance(input_ids[0], list)
    prompts = (prompt if batched else [prompt]) if prompt is not None else None
    ids_list = [factory.tokenize(p) for p in prompts] if prompts is not None else (
        input_ids if batched else [input_ids])
    if not ids_list:
        raise RequestError("the batch is empty", "prompt")
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids_list)
    if len(sps) != len(ids_list):
        raise RequestError("sampling_params has a different length than the batch", "sampling_params")
    rids = _batch_rids(rid, len(ids_list), batched)
    prepared: list[PreparedRequest] = []
    for ids, sp, r in zip(ids_list, sps, rids, strict=True):
        factory.check_ids(ids)
        if sp is not None and not isinstance(sp, dict):
            raise RequestError(f"sampling_params must be an object, got {type(sp).__name__}", "sampling_params")
        sp = dict(sp or {})
        if return_logprob is not None:
            sp["return_logprob"] = return_logprob
        if top_logprobs_num is not None:
            sp["top_logprobs_num"] = top_logprobs_num
        prepared.extend(factory.build(ids, factory.params(sp, len(ids)), r))
    return prepared, not batched and len(prepared) == 1


def _batch_rids(rid: str | list[str] | None, n: int, batched: bool) -> list[str | None]:
    if isinstance(rid, list):
        if len(rid) != n:
            raise RequestError("rid has a different length than the batch", "rid")
        return rid
    if rid is not None and batched:
        return [f"{rid}-{i}" for i in range(n)]
    return [rid] * n
