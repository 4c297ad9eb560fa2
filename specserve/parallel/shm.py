"""Shared-memory communication between the tensor-parallel ranks of one node.

gloo's TCP collectives cost about 1.5 ms each on the reference 2-core VM whatever their size (loopback round trips
and thread wake-ups), 25 of them a forward of the demo model: a TP=2 forward took eight times one process's. Ranks on
one node share memory instead, each spinning on its own core (they are pinned to separate cores) for the others:

- ``all_reduce(x)``: every rank copies x into its slot of the buffer, raises its sequence number, waits until every
  rank's number reached it, then sums the slots in rank order (so every rank gets the same bits);
- ``gather_columns(x)``: the same writes; rank 0 alone reads;
- ``send`` / ``recv``: rank 0's messages to the followers (the pickled batch of each forward), one at a time: a
  follower acknowledges a message once it has read it, and rank 0 writes the next only after every acknowledgement.

Slots alternate between two halves by sequence parity, so a rank may write call k + 1 while a slower one still reads
call k; before writing call k + 2 into the half call k used, a rank waits until every rank has passed call k + 1.
Payloads larger than a slot (long prefill chunks, large messages) take the torch.distributed path instead, decided
alike on every rank from the size (the sizes are the same on every rank). A wait checks ``alive`` now and then, so
rank 0 notices a follower that died instead of spinning forever; followers die with rank 0 (``die_with_parent``).
Waiting followers spin a while, then sleep 0.2 ms between looks, so an idle server costs little CPU.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch
import torch.distributed as dist

SLOT_FLOATS = 1 << 20  # float32 values per rank per half (4 MiB): a decode or verify step's activations and logits
MESSAGE_BYTES = 8 << 20  # the largest message sent through shared memory (8 MiB); larger ones go through gloo
SPIN_S = 0.02  # a waiting rank spins this long before it sleeps between looks
SLEEP_S = 0.0002
CHECK_EVERY_S = 0.1  # how often a wait calls ``alive``


class ShmComm:
    """The shared-memory channel of `size` ranks on one node, named `name`; rank 0 creates it (``create``)."""

    def __init__(self, name: str, rank: int, size: int, create: bool = False) -> None:
        self.rank, self.size = rank, size
        header = 8 * (4 * size + 4)  # int64: reduce seq [size], message ack [size], message seq and length, spare
        data = 2 * size * SLOT_FLOATS * 4
        total = header + data + MESSAGE_BYTES
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=total if create else 0)
        if not create:  # rank 0 owns the segment: a follower's exit must not unlink it (Python's resource tracker)
            resource_tracker.unregister(self.shm._name, "shared_memory")
        buf = self.shm.buf
        self.seq = np.ndarray((size,), np.int64, buf, 0)
        self.acks = np.ndarray((size,), np.int64, buf, 8 * size)
        self.msg = np.ndarray((2,), np.int64, buf, 16 * size)  # [message seq, its length (-1: sent through gloo)]
        self.slots = torch.from_numpy(np.ndarray((2, size, SLOT_FLOATS), np.float32, buf, header))
        self.box = np.ndarray((MESSAGE_BYTES,), np.uint8, buf, header + data)
        if create:
            self.seq[:] = 0
            self.acks[:] = 0
            self.msg[:] = 0
        self.calls = 0  # collectives run (the next sequence number - 1)
        self.sent = 0  # messages sent or received
        self.alive: Callable[[], None] | None = None  # raises when a rank is gone (rank 0 sets it: RankFailure)

    # ------------------------------------------------------------------ waiting
    def _wait(self, ready: Callable[[], bool], idle: bool = False) -> None:
        if ready():
            return
        start = last_check = time.perf_counter()
        while not ready():
            now = time.perf_counter()
            if now - last_check > CHECK_EVERY_S:
                last_check = now
                if self.alive is not None:
                    self.alive()
            if idle and now - start > SPIN_S:
                time.sleep(SLEEP_S)
            else:
                os.sched_yield()

    def _all_past(self, k: int) -> bool:
        return bool((self.seq >= k).all())

    # ------------------------------------------------------------------ collectives
    def _publish(self, x: torch.Tensor) -> tuple[int, int]:
        """Write x (float32 view) into this rank's slot of the next call -> (the call's number, its half)."""
        k = self.calls + 1
        self._wait(lambda: self._all_past(k - 1))  # every rank has read the half call k - 2 used
        half = k % 2
        flat = x.reshape(-1)
        self.slots[half, self.rank, : flat.numel()].copy_(flat)
        self.seq[self.rank] = k
        self.calls = k
        return k, half

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= SLOT_FLOATS

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (float32, every rank the same shape): a new tensor, the same bits on every rank."""
        n = x.numel()
        k, half = self._publish(x)
        self._wait(lambda: self._all_past(k))
        return self.slots[half, :, :n].sum(dim=0).view(x.shape)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [R, C] (float32) side by side as [R, size * C] on rank 0; None on the others."""
        rows, cols = x.shape
        k, half = self._publish(x.contiguous())
        if self.rank != 0:
            return None
        self._wait(lambda: self._all_past(k))
        parts = self.slots[half, :, : rows * cols].view(self.size, rows, cols)
        return parts.permute(1, 0, 2).reshape(rows, self.size * cols)

    # ------------------------------------------------------------------ rank 0's messages
    def send(self, obj) -> None:
        """Rank 0: one message to every follower (they have acknowledged the previous one first)."""
        m = self.sent  # rank 0 alone writes the message counter
        self._wait(lambda: bool((self.acks[1:] >= m).all()))
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        big = len(data) > MESSAGE_BYTES
        if not big:
            self.box[: len(data)] = np.frombuffer(data, np.uint8)
        self.msg[1] = -1 if big else len(data)
        self.msg[0] = m + 1  # published after the bytes (x86 keeps stores in order)
        if big:
            dist.broadcast_object_list([obj], src=0)
        self.sent = m + 1

    def recv(self):
        """A follower: the next message from rank 0 (waits, spinning then sleeping, for as long as it takes)."""
        m = self.sent + 1
        self._wait(lambda: int(self.msg[0]) >= m, idle=True)
        length = int(self.msg[1])
        if length < 0:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            obj = box[0]
        else:
            obj = pickle.loads(self.box[:length].tobytes())
        self.sent = m
        self.acks[self.rank] = m
        return obj

    def close(self, unlink: bool = False) -> None:
        self.seq = self.acks = self.msg = self.slots = self.box = None
        self.shm.close()
        if unlink:
            self.shm.unlink()
