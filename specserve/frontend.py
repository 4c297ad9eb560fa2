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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.grammar.spec import GrammarError, GrammarSpec
from specserve.request import InputLogprobs, Req, ReqOutput
from specserve.sampling.detokenizer import IncrementalDetokenizer, StopChecker
from specserve.sampling.params import SamplingParams


def token_text(tokenizer, token_id: int) -> str:
    """One token's text as logprob entries show it (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


WEIGHT_VERSION = "default"  # SGLang's --weight-version default: the weights never change while serving


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
        # a server's per-request limits (specserve.request_limits.RequestLimits), checked before any tokenizing,
        # and its admission check for that many samples (raises when there is no room); None: no limits
        self.limits = None
        self.admit: Callable[[int], None] | None = None
        # the structured-output grammar engine (specserve.grammar): requests' grammars are compiled here first, so an
        # invalid one is a 400 before the request is queued (the engine's compile is then a cache hit); None: off
        self.grammar = None

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
                raise RequestError(f"The input ({prompt_len} tokens) is longer than the model's context length "
                                   f"({self.context_len} tokens).", "prompt")  # SGLang's words
            if p.max_new_tokens is None:
                p.max_new_tokens = room
            p.verify(self.vocab_size)
            self.check_grammar(p)
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e), _param_of(str(e))) from e
        if p.return_logprob and p.logprob_start_len > prompt_len:
            raise RequestError(f"logprob_start_len ({p.logprob_start_len}) is higher than the number of input tokens "
                               f"({prompt_len}); use a smaller logprob_start_len", "logprob_start_len")
        if p.max_new_tokens > self.context_len:  # SGLang's words (clients match them)
            raise RequestError(f"max_new_tokens / max_completion_tokens is too large: {p.max_new_tokens}. This model "
                               f"supports at most {self.context_len} completion tokens.", "max_new_tokens")
        if prompt_len + p.max_new_tokens > self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens: "
                f"{prompt_len} tokens from the input and {p.max_new_tokens} for the completion (max_new_tokens). "
                "Reduce the input or max_new_tokens.", "max_new_tokens")
        return p

    def check_grammar(self, p: SamplingParams) -> None:
        """Compile the request's grammar (cached): RequestError naming its field when it is invalid or off."""
        if p.grammar is None:
            return
        field, text = p.grammar
        if self.grammar is None:
            raise RequestError("structured outputs are off on this server (--grammar-backend none)", field)
        try:
            self.grammar.compile(GrammarSpec.from_field(field, text))
        except GrammarError as e:
            raise RequestError(str(e), e.field) from None

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
        return StopChecker(self.tokenizer, p) if p.has_text_stops else None


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
    ids_logprobs: list = field(default_factory=list)
    input_logprobs: InputLogprobs | None = None
    cached_tokens: int = 0
    spec: dict = field(default_factory=dict)
    start: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        has_stops = self.params.has_text_stops
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
        self.ids_logprobs.extend(out.new_ids_logprobs)
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
        self.cached_tokens, self.spec = out.cached_tokens, out.spec
        if self._detok is not None:
            shown = out.new_token_ids
            if self._trims_stop_token(out.finished_reason):
                shown = shown[:-1]  # a matched stop token's text is not output (SGLang), unless no_stop_trim
            delta = self._detok.add(shown)
            if out.finished_reason is not None:
                delta += self._detok.flush()
        else:
            delta = out.new_text or ""
        self.text += delta
        self.finished_reason = out.finished_reason
        return self.chunk(delta, out.new_token_ids, len(out.new_logprobs))

    def _trims_stop_token(self, reason: dict | None) -> bool:
        return (reason is not None and reason.get("type") == "stop" and isinstance(reason.get("matched"), int)
                and not self.params.no_stop_trim)

    def meta_info(self, logprobs_from: int = 0) -> dict:
        """SGLang's meta_info; logprobs_from: the first output position whose logprob entries are included."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
            "e2e_latency": time.monotonic() - self.start,
            "weight_version": WEIGHT_VERSION,
        }
        if self.params.return_logprob:
            meta.update(self._logprob_meta(logprobs_from))
        meta.update(self.spec)
        return meta

    def _logprob_meta(self, start: int) -> dict:
        """The logprob fields of meta_info, SGLang's layout: entries [logprob, token_id, text or None]; per scored
        position, the top-n and the token_ids_logprob entries (None where a position has none)."""
        p, entry = self.params, self._entry
        inp = self.input_logprobs
        in_ids = inp.token_ids if inp is not None else []
        meta = {
            "input_token_logprobs": [entry(lp, t) for lp, t in zip(inp.logprobs, in_ids, strict=True)] if inp else [],
            "output_token_logprobs": [entry(lp, t) for lp, t in self.logprobs[start:]],
        }
        if p.top_logprobs_num:
            meta["input_top_logprobs"] = [self._row(r) for r in inp.top] if inp else []
            meta["output_top_logprobs"] = [self._row(r) for r in self.top_logprobs[start:]]
        if p.token_ids_logprob:
            meta["input_token_ids_logprobs"] = [self._row(r) for r in inp.ids] if inp else []
            meta["output_token_ids_logprobs"] = [self._row(r) for r in self.ids_logprobs[start:]]
        return meta

    def _entry(self, logprob: float | None, token_id: int) -> tuple:
        text = token_text(self.tokenizer, token_id) if self.params.return_text_in_logprobs else None
        return (logprob, token_id, text)

    def _row(self, row: list[tuple[float, int]] | None) -> list[tuple] | None:
        return None if row is None else [self._entry(lp, t) for lp, t in row]

    def chunk(self, delta_text: str, delta_ids: list[int], n_new_logprobs: int) -> dict:
        meta = self.meta_info(logprobs_from=len(self.logprobs) - n_new_logprobs)
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
        new_ids_logprobs=[x for o in outs for x in o.new_ids_logprobs],
        input_logprobs=next((o.input_logprobs for o in outs if o.input_logprobs is not None), None),
        new_text=None if last.new_text is None else "".join(t or "" for t in texts),
    )


# SGLang Engine.generate arguments specserve does not honour yet: accepted at these off values only
ENGINE_OFF_ARGS = {"image_data": (None,), "audio_data": (None,), "video_data": (None,), "input_embeds": (None,),
                   "lora_path": (None,), "custom_logit_processor": (None,), "return_hidden_states": (None, False),
                   "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
                   "data_parallel_rank": (None, 0)}


def check_off_args(args: dict) -> None:
    """SGLang's generate() arguments beyond specserve's: TypeError for a name SGLang does not have either,
    RequestError naming it for one specserve would have to honour."""
    for name, value in args.items():
        if name not in ENGINE_OFF_ARGS:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        if value not in ENGINE_OFF_ARGS[name]:
            raise RequestError(f"{name} is not supported by specserve (accepted: {ENGINE_OFF_ARGS[name]})", name)


# SGLang's request-level fields carried per request in its SamplingParams (scalars, or a list: one per prompt)
REQUEST_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob",
                          "return_text_in_logprobs", "temp_scaled_logprobs")


def prepare_requests(
    factory: RequestFactory,
    prompt: str | list[str] | None,
    sampling_params: dict | list[dict] | None,
    input_ids: list[int] | list[list[int]] | None,
    rid: str | list[str] | None = None,
    **request_fields,
) -> tuple[list[PreparedRequest], bool]:
    """The SGLang ``generate`` input (text or ids, single or batch, per-prompt or shared sampling params) as
    prepared requests, n samples of each prompt in a row. Returns (prepared, single): single is True when
    the caller gets one result dict (one prompt, n == 1) rather than a list. Shared by Engine and /generate.

    request_fields: the REQUEST_LOGPROB_FIELDS given at the request's top level (None = not given), each one
    value for every prompt or a list of one per prompt (token_ids_logprob: a list of ids, or a list of lists).
    """
    unknown = set(request_fields) - set(REQUEST_LOGPROB_FIELDS)
    if unknown:
        raise TypeError(f"unknown request fields {sorted(unknown)}")
    if (prompt is None) == (input_ids is None):
        raise RequestError("give exactly one of prompt and input_ids", "prompt")
    batched = isinstance(prompt, list) if prompt is not None else bool(input_ids) and isinstance(input_ids[0], list)
    prompts = (prompt if batched else [prompt]) if prompt is not None else None
    n_prompts = len(prompts) if prompts is not None else len(input_ids) if batched else 1
    if n_prompts == 0:
        raise RequestError("the batch is empty", "prompt")
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n_prompts
    if len(sps) != n_prompts:
        raise RequestError("sampling_params has a different length than the batch", "sampling_params")
    _check_limits(factory, prompts, n_prompts, sps, request_fields)
    ids_list = [factory.tokenize(p) for p in prompts] if prompts is not None else (
        input_ids if batched else [input_ids])
    rids = _batch_rids(rid, len(ids_list), batched)
    fields = [_per_prompt(name, value, len(ids_list)) for name, value in request_fields.items() if value is not None]
    prepared: list[PreparedRequest] = []
    for i, (ids, sp, r) in enumerate(zip(ids_list, sps, rids, strict=True)):
        factory.check_ids(ids)
        if sp is not None and not isinstance(sp, dict):
            raise RequestError(f"sampling_params must be an object, got {type(sp).__name__}", "sampling_params")
        sp = dict(sp or {})
        for name, values in fields:
            sp[name] = values[i]
        prepared.extend(factory.build(ids, factory.params(sp, len(ids)), r))
    _check_unique_rids(prepared)
    return prepared, not batched and len(prepared) == 1


def _check_limits(factory: RequestFactory, prompts: list[str] | None, n_prompts: int, sps: list,
                  request_fields: dict) -> None:
    """The server's limits and admission, before anything is tokenized or built (no-op for the Engine)."""
    if factory.limits is None:
        return
    samples = factory.limits.check(prompts, n_prompts, sps, request_fields)
    if factory.admit is not None:
        factory.admit(samples)


def _check_unique_rids(prepared: list[PreparedRequest]) -> None:
    """Every request of a batch needs its own rid: outputs, aborts and results are routed by it."""
    seen: set[str] = set()
    for p in prepared:
        if p.req.rid in seen:
            raise RequestError(f"rid {p.req.rid!r} is used by two requests of the batch; give each its own", "rid")
        seen.add(p.req.rid)


def _per_prompt(name: str, value, n: int) -> tuple[str, list]:
    """A request-level field as one value per prompt: a list of n (per prompt) or one value for all."""
    per_prompt = isinstance(value, list) and (name != "token_ids_logprob" or (value and isinstance(value[0], list)))
    if not per_prompt:
        return name, [value] * n
    if len(value) != n:
        raise RequestError(f"{name} has {len(value)} entries for a batch of {n} prompts", name)
    return name, value


def _batch_rids(rid: str | list[str] | None, n: int, batched: bool) -> list[str | None]:
    if isinstance(rid, list):
        if len(rid) != n:
            raise RequestError("rid has a different length than the batch", "rid")
        return rid
    if rid is not None and batched:
        return [f"{rid}-{i}" for i in range(n)]
    return [rid] * n
