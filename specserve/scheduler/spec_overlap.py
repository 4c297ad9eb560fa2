"""The overlap scheduler for speculative decoding ("Spec V2": ``SPECSERVE_ENABLE_SPEC_V2=1`` or SGLang's
``SGLANG_ENABLE_SPEC_V2=True``; draft trees of topk 1 only).

A speculative step has a forward part and an output part (``SpecDecoder.forward_step`` / ``process``):

- forward part F: draft, verify forward, acceptance, KV commit, appending the verified tokens, the drafter's
  catch-up. The next step depends on all of it. Finishes that need no text (a stop id, max_new_tokens, the
  context length) are decided here, so such a request takes no further step.
- output part H: every new token through the finish checks in order (stop strings need incremental
  detokenization), logprobs, counters, the per-request outputs. The next step does not depend on it, except
  that a stop string ends the request.

Without overlap the step is F(t) then H(t). With it, F(t) runs on a forward thread while the scheduler thread
runs H(t-1), and ``run`` returns step t-1's outputs:

    forward thread     F(t-1)  | F(t)                | F(t+1)               |
    scheduler thread           | H(t-1) .. join F(t) | H(t) .. join F(t+1)  |

On CUDA the forward part is mostly kernel launches and waits for the device with the GIL released, so the host
work can hide behind the GPU (not measured yet). On CPU both parts need the GIL for their Python, so they mostly
take turns: no measurable gain on the 2-core CPU (docs/benchmarks.md). A request whose stop string H finds at step t-1
was already part of F(t): its tokens from F(t) are dropped and its output and KV trimmed back when the pipeline
joins (SGLang's overlap scheduler also finds finishes one step late). Every token comes from the same
verification as without overlap, so outputs are identical.

The pipeline is emptied (``drain``) before anything else touches the running requests: a prefill, a plain step
of batch-aware speculation, a retraction, an abort.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.request import Req, ReqOutput
    from specserve.scheduler.spec_decode import SpecDecoder, StepRecord
    from specserve.speculative.batch_policy import TreeShape


class OverlapPipeline:
    def __init__(self, spec: SpecDecoder) -> None:
        self.spec = weakref.proxy(spec)  # the decoder owns the pipeline: no reference cycle keeping both alive
        self.platform = spec.runner.platform
        self.pending: StepRecord | None = None  # the last forward part, its outputs not processed yet
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-forward")
        self.overlapped_steps = 0  # steps whose output part ran beside a forward part

    def run(self, reqs: list[Req]) -> list[ReqOutput]:
        """Start the forward part of this step, process the previous step's outputs meanwhile, join."""
        spec = self.spec
        active = [r for r in reqs if not r.spec_stopped]
        kind = spec.batch_kind(active)
        shape = spec.choose_shape(active, kind) if active else None
        if active and shape is None:  # a plain step (batch-aware speculation): it needs the pipeline empty
            outputs = self.drain()
            return outputs + spec.timed_plain_step([r for r in reqs if not r.finished])
        started = spec.step_start()
        if active:  # one thread's OpenMP pool at a time runs the forwards: free this one's (platform/cpu/omp.py)
            self.platform.release_thread_pool()
        future = self._thread.submit(self._forward, active, shape) if active else None
        try:
            outputs, done = spec.process(self.pending) if self.pending is not None else ([], [])
        except BaseException:  # let the forward part end before the scheduler aborts requests it is using
            self.pending = None
            if future is not None:
                future.exception()
            raise
        if future is not None and self.pending is not None:
            self.overlapped_steps += 1
        self.pending = _result(future)  # exceptions of the forward part surface here
        spec.release_done(done)  # the forward thread is idle: KV and drafter state can be given back
        if self.pending is not None:
            spec.record_step(started, len(active), True, self.pending.num_tokens, kind)
        return outputs

    def drain(self) -> list[ReqOutput]:
        """Process the pending step's outputs now (nothing runs beside)."""
        if self.pending is None:
            return []
        record, self.pending = self.pending, None
        outputs, done = self.spec.process(record)
        self.spec.release_done(done)
        return outputs

    def _forward(self, reqs: list[Req], shape: TreeShape) -> StepRecord:
        self.platform.apply_threads()  # a count set on the scheduler thread does not reach this one
        with torch.inference_mode():  # per thread, like the scheduler thread's
            self.spec.flush_backlog(reqs)  # the drafter catches up on plain-decoded tokens
            return self.spec.forward_step(reqs, shape)


def _result(future: Future | None):
    return None if future is None else future.result()
