"""The shared-memory channel of one node's ranks (``specserve/parallel/shm.py``) between real processes: sums with the
same bits on every rank, gathers, calls back to back (the two halves), payloads too large for a slot and messages
too large for the box going through torch.distributed, and a wait that notices a dead peer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.parallel import shm
from specserve.parallel.shm import ShmComm
from specserve.utils import free_port

SIZE = 3


def _rank(rank: int, name: str, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    c = ShmComm(name, rank, SIZE)
    gen = torch.Generator().manual_seed(rank)
    out = {}
    sums = []
    for i in range(5):  # back to back: the halves alternate, a fast rank never overwrites what a slow one reads
        x = torch.randn(4, 7, generator=gen) * (i + 1)
        sums.append(c.all_reduce(x))
        out.setdefault("mine", []).append(x)
    out["sums"] = sums
    out["gathered"] = c.gather_columns(torch.full((2, 3), float(rank)))
    out["fits_big"] = c.fits(torch.empty(shm.SLOT_FLOATS + 1))
    if rank == 0:
        c.send(("small", torch.arange(5)))
        c.send(("big", torch.zeros(shm.MESSAGE_BYTES // 4 + 10)))  # over the box: through gloo
    else:
        out["messages"] = [c.recv(), c.recv()]
    results[rank] = out
    c.close()
    dist.destroy_process_group()


def test_all_reduce_gather_and_messages_between_processes():
    name = f"specserve-test-{free_port()}"
    owner = ShmComm(name, 0, SIZE, create=True)  # the segment outlives the ranks, as rank 0's does
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_rank, args=(name, free_port(), results), nprocs=SIZE)
            got = dict(results)
    finally:
        owner.close(unlink=True)
    for i in range(5):
        want = sum(got[r]["mine"][i] for r in range(SIZE))
        for r in range(SIZE):
            assert torch.allclose(got[r]["sums"][i], want, atol=1e-6)
            assert torch.equal(got[r]["sums"][i], got[0]["sums"][i])  # the same bits everywhere
    assert torch.equal(got[0]["gathered"], torch.tensor([[0.0] * 3 + [1.0] * 3 + [2.0] * 3] * 2))
    assert got[1]["gathered"] is None and got[2]["gathered"] is None
    assert not got[0]["fits_big"]
    for r in (1, 2):
        (k1, small), (k2, big) = got[r]["messages"]
        assert (k1, k2) == ("small", "big") and torch.equal(small, torch.arange(5)) and big.numel() > 2**21


def test_a_wait_for_a_dead_peer_raises_from_alive(monkeypatch):
    monkeypatch.setattr(shm, "CHECK_EVERY_S", 0.01)
    name = f"specserve-test-{free_port()}"
    c = ShmComm(name, 0, 2, create=True)
    try:
        def alive():
            raise ConnectionError("rank 1 exited")

        c.alive = alive
        with pytest.raises(ConnectionError, match="rank 1 exited"):
            c.all_reduce(torch.ones(3))  # rank 1 never arrives
    finally:
        c.close(unlink=True)
