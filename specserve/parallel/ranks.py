"""The processes of a tensor-parallel group: rank 0 leads, the others follow.

Rank 0 is the engine: its scheduler, drafter and sampler run there and nowhere else. Before each computation over the
sharded target it tells the other ranks what to run, one message (through the node's shared memory, ``shm.py``, or a
torch.distributed broadcast across nodes), and all ranks then run it together (their collectives inside:
``specserve.models.tensor_parallel``):

    ("forward", ForwardBatch)    a target forward (prefill, decode, verify); the batch's tensors, without the KV pool
                                 (each rank has its own, of its KV heads)
    ("embed", ids [T])           the embedding of tokens, for a drafter on rank 0
    ("logits", hidden [R, h])    the LM head over hidden states, for a drafter or prompt logprobs on rank 0
    ("stop", None)               exit

Nothing else touches a follower's state: KV slots are decided on rank 0 and travel inside each forward, so a
follower needs no scheduler, tokenizer or request. Drafters stay whole on rank 0 (they are small); those that read
the target's embedding or LM head bring the followers in through ``embed`` / ``logits``.

Local ranks are started by rank 0 (``Leader``) as processes of their own (``python -m specserve.parallel.ranks``); on
a node other than the first (``--nnodes``, ``--node-rank``), ``run_node`` starts that node's ranks. Each rank gets its
own share of the CPUs (``rank_cpus``), pinned, with as many torch threads. A rank that dies is seen by rank 0 at its
next message or within a shared-memory wait (it polls its followers), or as a failed gloo collective across nodes:
``RankFailure``, which ends the engine (the server's model worker exits, so the server stops serving) instead of
leaving requests waiting. Followers die with rank 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from specserve.config import ConfigError, ServerArgs
from specserve.models.tensor_parallel import TPGroup
from specserve.parallel.shm import ShmComm
from specserve.utils import die_with_parent, free_port

logger = logging.getLogger(__name__)

#: how long a collective may wait for the other ranks. Followers wait for rank 0's next message for as long as the
#: server is idle, so this is long; a rank that died is seen at once (its connections close), not after it.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


class RankFailure(RuntimeError):
    """A collective with the other tensor-parallel ranks failed: one of them is gone."""


def rank_cpus(cpus: list[int], numa_nodes: list[set[int]], ranks: int) -> list[list[int]]:
    """The CPUs each of this node's `ranks` ranks is pinned to: the usable CPUs in NUMA-node order, cut into equal
    consecutive shares (so ranks fill a node before the next), the remainder left unused. A rank always gets one."""
    node_of = {c: i for i, node in enumerate(numa_nodes) for c in node}
    ordered = sorted(cpus, key=lambda c: (node_of.get(c, 0), c))
    per = max(1, len(ordered) // ranks)
    return [ordered[(r * per) % len(ordered):(r * per) % len(ordered) + per] for r in range(ranks)]


def numa_nodes(root: str = "/sys/devices/system/node") -> list[set[int]]:
    """The CPUs of each NUMA node (Linux sysfs); [] where unknown."""
    nodes = []
    if not os.path.isdir(root):
        return nodes
    for name in sorted(os.listdir(root)):
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(os.path.join(root, name, "cpulist")) as f:
                    nodes.append(parse_cpulist(f.read()))
            except OSError:
                continue
    return nodes


def parse_cpulist(text: str) -> set[int]:
    """ "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin(local_rank: int, local_ranks: int) -> list[int] | None:
    """Pin this process to its share of the CPUs (``rank_cpus``); None where affinity is not available."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    share = rank_cpus(sorted(os.sched_getaffinity(0)), numa_nodes(), local_ranks)[local_rank]
    os.sched_setaffinity(0, share)
    return share


def ranks_per_node(args: ServerArgs) -> int:
    return args.tp_size // args.nnodes


def init_address(args: ServerArgs) -> str:
    """host:port of rank 0's rendezvous: --dist-init-addr, else a free local port (one node)."""
    return args.dist_init_addr or f"127.0.0.1:{free_port()}"


def on_cuda(args: ServerArgs) -> bool:
    """Whether the ranks run on CUDA devices (--device cuda, or auto where CUDA is available)."""
    return args.device == "cuda" or args.device == "auto" and torch.cuda.is_available()


def shm_name(args: ServerArgs, address: str) -> str | None:
    """The shared-memory channel's name when every rank is on this node and on CPU (``shm.py``), else None."""
    if args.nnodes > 1 or on_cuda(args):
        return None
    return f"specserve-tp-{address.rpartition(':')[2]}"


def join_group(args: ServerArgs, rank: int, address: str, comm: ShmComm | None = None) -> TPGroup:
    backend = "nccl" if on_cuda(args) else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=args.tp_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, args.tp_size, comm=comm)


class Leader:
    """Rank 0's side: starts this node's other ranks, joins the group, and tells the followers what to run."""

    def __init__(self, args: ServerArgs) -> None:
        if dist.is_initialized():
            raise ConfigError("--tp-size > 1: one tensor-parallel engine per process, and one is running here")
        self.args = args
        self.address = init_address(args)
        local = ranks_per_node(args)
        self.saved_affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        name = shm_name(args, self.address)
        self.comm = ShmComm(name, 0, args.tp_size, create=True) if name is not None else None
        self.procs: dict[int, subprocess.Popen] = {}
        self.closed = False
        try:
            self.procs = {rank: start_rank(args, rank, rank, local, self.address) for rank in range(1, local)}
            if self.comm is not None:
                self.comm.alive = self.check_alive
            pin(0, local)
            self.group = join_group(args, 0, self.address, self.comm)
        except BaseException:
            self.closed = True
            for p in self.procs.values():
                p.kill()
            if self.comm is not None:
                self.comm.close(unlink=True)
            raise
        self.group.link = self
        self.messages, self.message_seconds = 0, 0.0

    def check_alive(self) -> None:
        """RankFailure when a follower has exited (shared-memory waits call this now and then)."""
        dead = self.dead_ranks()
        if dead:
            raise RankFailure(f"tensor parallelism: a rank is gone ({dead})")

    def send(self, kind: str, payload) -> None:
        start = time.perf_counter()
        try:
            if self.comm is not None:  # its waits call check_alive
                self.comm.send((kind, payload))
            else:
                dist.broadcast_object_list([(kind, payload)], src=0)
        except RankFailure:
            raise
        except (RuntimeError, OSError) as e:
            raise RankFailure(f"tensor parallelism: a rank is gone ({self.dead_ranks() or e})") from e
        self.messages += 1
        self.message_seconds += time.perf_counter() - start

    def info(self) -> dict:
        """The group's counters for the server info: messages to the followers, and rank 0's collectives."""
        return {**self.group.info(), "tp_messages": self.messages, "tp_message_seconds": self.message_seconds}

    def setup(self, max_total_tokens: int, max_positions: int) -> None:
        """The KV pool size and RoPE reach the followers size theirs by (rank 0 decides both)."""
        self.send("setup", (max_total_tokens, max_positions))

    def forward(self, fb) -> None:
        self.send("forward", portable(fb))

    def announce(self, kind: str, tensor: torch.Tensor) -> None:
        """Before rank 0 computes the embedding or the logits alone (``embed`` / ``logits``)."""
        self.send(kind, tensor.detach().clone())

    def dead_ranks(self) -> str:
        return "; ".join(f"rank {rank} exited with code {p.returncode}" for rank, p in self.procs.items()
                         if p.poll() is not None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if not self.dead_ranks():
                self.send("stop", None)
        except RankFailure:
            pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.comm is not None:
            self.comm.close(unlink=True)
        if self.saved_affinity is not None:
            os.sched_setaffinity(0, self.saved_affinity)


def start_rank(args: ServerArgs, rank: int, local_rank: int, local_ranks: int, address: str) -> subprocess.Popen:
    """A follower rank as its own interpreter (``python -m specserve.parallel.ranks``, its arguments pickled on
    stdin): no re-import of the caller's main module, as multiprocessing's spawn would need."""
    proc = subprocess.Popen([sys.executable, "-m", "specserve.parallel.ranks"], stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps((os.getpid(), (args, rank, local_rank, local_ranks, address))))
    proc.stdin.close()
    return proc


def portable(fb):
    """The ForwardBatch as the followers get it: no KV pool, no host tuning object, and every tensor its own copy
    (a view of the req_to_token table would otherwise pickle the whole table)."""
    return _own(dataclasses.replace(fb, kv_pool=None, rope_rows={}))


def _own(x):
    """x with its tensors' own storage and without ``platform`` fields, through dataclasses, lists and tuples."""
    if isinstance(x, torch.Tensor):
        return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: None if f.name == "platform" else _own(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})  # the others are derived
    if isinstance(x, list):
        return [_own(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_own(v) for v in x)
    return x


def _local(x, platform):
    """A received batch's metadata gets this rank's host tuning object back."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            value = getattr(x, f.name)
            if f.name == "platform":
                setattr(x, f.name, platform)
            elif isinstance(value, list | tuple):
                for v in value:
                    _local(v, platform)
            else:
                _local(value, platform)
    elif isinstance(x, tuple):
        for v in x:
            _local(v, platform)


def follow(args: ServerArgs, rank: int, local_rank: int, local_ranks: int, address: str) -> None:
    """A follower rank's whole life: join, load its shard, then run what rank 0 says until it says stop (or is
    gone)."""
    from specserve.cache.kv_pool import KVPool
    from specserve.models.loader import load_model
    from specserve.platform import platform_policy

    logging.basicConfig(level=args.log_level.upper())
    pin(local_rank, local_ranks)
    device = torch.device("cpu")
    if on_cuda(args):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    platform = platform_policy(args, device)
    platform.configure_threads()
    name = shm_name(args, address)
    comm = ShmComm(name, rank, args.tp_size) if name is not None else None
    group = join_group(args, rank, address, comm)
    with torch.inference_mode():
        model, spec, _ = load_model(args.model_path, args.dtype, device, load_format=args.load_format,
                                    seed=args.random_seed, tp=group)
        platform.pack_weights(model)
        attn = model.model.layers[0].self_attn
        pool = None
        while True:
            try:
                if comm is not None:
                    kind, payload = comm.recv()
                else:
                    box = [None]
                    dist.broadcast_object_list(box, src=0)
                    kind, payload = box[0]
            except (RuntimeError, OSError):
                logger.info("tensor-parallel rank %d: rank 0 is gone; exiting", rank)
                return
            if kind == "stop":
                break
            if kind == "setup":
                slots, positions = payload
                pool = KVPool(spec.num_layers, slots, attn.num_kv_heads, attn.head_dim,
                              next(model.parameters()).dtype, device, platform.kv_store())
                model.set_max_positions(positions)
            elif kind == "forward":
                payload.kv_pool = pool
                _local(payload.attn, platform)
                model(payload)
            elif kind == "embed":
                model.local_embed(payload.to(device))
            elif kind == "logits":
                model.local_logits(payload.to(device))
    dist.destroy_process_group()
    if comm is not None:
        comm.close()


def run_node(args: ServerArgs) -> None:
    """``--node-rank`` > 0: this node's ranks of the group (no scheduler, no server); returns when rank 0 stops."""
    local = ranks_per_node(args)
    first = args.node_rank * local
    procs = [start_rank(args, first + r, r, local, args.dist_init_addr) for r in range(1, local)]
    try:
        follow(args, first, 0, local, args.dist_init_addr)
    finally:
        for p in procs:
            p.wait()


def main() -> None:
    """A follower rank started by ``start_rank``: it dies with its parent (Linux), and follows."""
    die_with_parent()
    parent, follow_args = pickle.loads(sys.stdin.buffer.read())
    if os.getppid() != parent:  # the parent died before die_with_parent could take effect
        return
    follow(*follow_args)


if __name__ == "__main__":
    main()
