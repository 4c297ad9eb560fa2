"""Sampled verification of a draft tree in one operator call (``race_walk`` in ``ops.cpp``).

A sampled request's tree is verified by the exponential race (``specserve.sampling.race``): every node's winner,
argmax p(x) / E(x) with the noise of the node's output position, then the greedy walk over those winners
(``verify.verify_greedy`` over ``verify.race_node_ids``). That races all N nodes, each over the whole vocabulary,
where the walk reads the winners of the nodes it reaches only (the accepted path and the node after it), and it
takes a dozen operator and numpy calls. The operator walks the tree and races the nodes it reaches, with the same
noise kernel and torch's arithmetic (a float32 division per token, the first index among equal values), so it gives
the same result. The CPU platform offers it (``CpuPolicy.race_walk``) where ``ops.cpp`` is built, and the
speculative decoder hands it to ``verify.race_verify``.
"""

from __future__ import annotations

import torch

from specserve.platform.cpu.ops import cpu_op, registered


def race_walk_reference(probs, tokens, parents, depth, num_nodes, keys):
    """The operator's walk in Python, node by node with ``race_argmax`` and ``exponentials``."""
    from specserve.sampling.race import exponentials, race_argmax

    B, N, V = probs.shape
    D1 = keys.shape[1]
    ids = torch.arange(V, device=probs.device)
    accept_len = torch.zeros(B, dtype=torch.int64)
    path = torch.full((B, D1), -1, dtype=torch.int64)
    bonus, last = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64)
    new_tokens = torch.full((B, D1), -1, dtype=torch.int64)
    for b in range(B):
        cur, accepted = 0, 0
        path[b, 0] = 0
        while True:
            key = keys[b, min(int(depth[b, cur]), D1 - 1)].view(1, 2)
            winner = int(race_argmax(probs[b, cur].view(1, V), exponentials(key, ids))[0])
            children = [c for c in range(1, int(num_nodes[b]))
                        if int(parents[b, c]) == cur and int(tokens[b, c]) == winner]
            if not children or accepted + 1 >= D1:
                bonus[b] = winner
                break
            cur = children[0]
            new_tokens[b, accepted] = tokens[b, cur]
            accepted += 1
            path[b, accepted] = cur
        accept_len[b], last[b], new_tokens[b, accepted] = accepted, cur, bonus[b]
    return accept_len, path, bonus, last, new_tokens


def _fake(probs, tokens, parents, depth, num_nodes, keys):
    B, D1 = probs.shape[0], keys.shape[1]
    one, two = tokens.new_empty(B), tokens.new_empty(B, D1)
    return one, two, one.clone(), one.clone(), two.clone()


# probs [B, N, V] float32: each node's processed target distribution; tokens, parents, depth [B, N]; num_nodes [B];
# keys [B, D + 1, 2] int32 (column d: the race's keys at a node of depth d) -> verify.VerifyResult's fields
# (accept_len [B], accepted_nodes [B, D + 1], bonus [B], last [B], new_tokens [B, D + 1])
race_walk = cpu_op("race_walk(Tensor probs, Tensor tokens, Tensor parents, Tensor depth, Tensor num_nodes, "
                   "Tensor keys) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", race_walk_reference, _fake)


def native() -> bool:
    """``ops.cpp`` registered the operator's C++ implementation."""
    return registered("race_walk")
