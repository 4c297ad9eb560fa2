"""Requests waiting for their grammar: compiled on a small thread pool, off the scheduler thread, so a large schema
never stalls the other requests' decoding; each comes back to the scheduler loop through its inbox. A request whose
grammar is compiled already (cached by its text) gets its matcher at once instead."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from specserve.grammar.backend import GrammarBackend, Matcher, new_bitmask
from specserve.grammar.spec import GrammarSpec
from specserve.request import Req, ReqOutput, unstarted_output

#: compile threads per engine: grammars compile while the forwards use the cores, so one is enough to keep the
#: scheduler thread free; a second lets a small schema pass a large one
COMPILE_THREADS = 2


class GrammarCompiles:
    def __init__(self, backend: GrammarBackend, post: Callable[[tuple], None], threads: int = COMPILE_THREADS) -> None:
        self.backend = backend
        self.post = post  # puts ("compiled", (req, future)) into the scheduler loop's inbox
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="specserve-grammar")
        self.waiting: dict[str, Req] = {}  # rid -> request whose grammar is compiling

    def start(self, req: Req) -> Req | None:
        """-> the request with its matcher, ready to schedule, when its grammar is compiled already (the frontend
        compiles a request's grammar to check it, so this is the rule: a matcher then costs microseconds, and the
        request joins the running batch with the others that came with it); else None: it waits for its compile on
        the pool."""
        spec = GrammarSpec.from_field(*req.params.grammar)
        compiled = self.backend.cached(spec)
        if compiled is not None:
            req.grammar = self.backend.matcher(compiled)
            return req
        self.waiting[req.rid] = req
        future = self.pool.submit(self._matcher, spec)
        future.add_done_callback(lambda f: self.post(("compiled", (req, f))))
        return None

    def _matcher(self, spec: GrammarSpec) -> Matcher:
        matcher = self.backend.matcher(self.backend.compile(spec))
        matcher.fill(new_bitmask(1, self.backend.vocab_size), 0)  # builds lazy parser tables here, not in a step
        return matcher

    def finish(self, req: Req, future: Future) -> tuple[Req | None, ReqOutput | None]:
        """-> (the request, ready to schedule, or None) and (its error output, when the compile failed)."""
        if self.waiting.pop(req.rid, None) is not req:  # aborted meanwhile
            return None, None
        try:
            req.grammar = future.result()
        except Exception as e:  # noqa: BLE001 - GrammarError, or anything the engine raised: the request ends
            return None, unstarted_output(req, {"type": "abort", "message": f"grammar compile failed: {e}"})
        return req, None

    def abort(self, rid: str) -> ReqOutput | None:
        """End a request still compiling; None if it is not here."""
        req = self.waiting.pop(rid, None)
        return None if req is None else unstarted_output(req, {"type": "abort", "message": "aborted"})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
