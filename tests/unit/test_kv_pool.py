"""The KV pool's buffers: zeros that cost no memory until written (CPU), and the meta-device model build that
imports no compiler."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specserve.cache.kv_pool import KVPool, lazy_zeros
from specserve.models.direct_call import Embedding

MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
def test_lazy_zeros_are_zeros_of_the_dtype(dtype):
    t = lazy_zeros((5, 3, 4), dtype, "cpu")
    assert t.dtype == dtype and t.shape == (5, 3, 4) and not t.any()
    t[2] = 1  # writable, in place
    assert int(t.sum()) == 12


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set size from /proc")
def test_a_pool_costs_memory_only_where_written():
    before = rss_bytes()
    pool = KVPool(num_layers=4, num_slots=(256 * MIB) // (4 * 2 * 8 * 64 * 2), num_kv_heads=8, head_dim=64,
                  dtype=torch.bfloat16, device="cpu")  # 256 MiB of K and V buffers
    allocated = rss_bytes() - before
    pool.k[0][: pool.num_slots // 2] = 1.0  # half of one layer's K: 16 MiB
    written = rss_bytes() - before
    assert allocated < 8 * MIB, allocated / MIB  # torch.zeros would make all 256 MiB resident here
    assert written - allocated > 12 * MIB, (written - allocated) / MIB


def test_building_a_model_on_meta_imports_no_compiler():
    """The loader builds on the meta device; torch's random init of an embedding there imported torch._dynamo
    (about 1 s of start-up) for values that the checkpoint replaces."""
    code = ("import sys, torch\n"
            "from specserve.models.direct_call import Embedding\n"
            "with torch.device('meta'):\n"
            "    Embedding(1000, 64)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    torch.manual_seed(0)
    a = Embedding(10, 4).weight
    torch.manual_seed(0)
    assert torch.equal(a, torch.nn.Embedding(10, 4).weight)  # off meta (trainers' models): torch's own init
