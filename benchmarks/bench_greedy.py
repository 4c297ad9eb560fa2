"""Greedy picks on CPU: torch's ``argmax``, torch's ``max(dim).indices`` and ``sampling.sampler.greedy_ids`` (numpy's
argmax for float32 logits), per call, over logits [batch, vocab]; every pick checked equal to ``argmax``'s.

Printed: one row per (vocab, dtype), each batch's microseconds as argmax / max / greedy_ids (median of 5 batches
of calls).

    python benchmarks/bench_greedy.py
"""

from __future__ import annotations

import argparse

import torch

from bench_ops import per_call_us
from specserve.sampling.sampler import greedy_ids


def pickers(x: torch.Tensor) -> dict:
    """The three ways to pick each row's argmax of logits x [B, V]."""
    return {"argmax": lambda: x.argmax(dim=-1), "max": lambda: x.max(dim=-1).indices,
            "greedy_ids": lambda: greedy_ids(x)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="4096,32000,49152")
    p.add_argument("--batches", default="1,8,16,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--work", type=float, default=1e7, help="logits read per timed batch of calls (sets the calls)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in args.dtypes.split(","):
        for vocab in map(int, args.vocabs.split(",")):
            cells = []
            for batch in map(int, args.batches.split(",")):
                x = torch.randn(batch, vocab, generator=gen).to(getattr(torch, dtype))
                assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
                calls = max(int(args.work / (batch * vocab)), 5)
                cells.append({"batch": batch, **{name: per_call_us(fn, calls) for name, fn in pickers(x).items()}})
            rows.append({"vocab": vocab, "dtype": dtype, "batches": cells})
            print(f"{vocab:>7} {dtype:>9} | " + " | ".join(
                f"{c['argmax']:.0f} / {c['max']:.0f} / {c['greedy_ids']:.0f}" for c in cells), flush=True)
    return rows


if __name__ == "__main__":
    main()
