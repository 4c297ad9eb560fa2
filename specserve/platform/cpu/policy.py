"""CpuPolicy: where the CPU tweaks apply (the allocator, threads, oneDNN packing, float32 drafts' mixed linears,
query-head folding).

Each constant below carries the measurement behind it; the mechanisms live beside this file (``malloc.py``,
``omp.py``, ``packing.py``) and in attention's ``_attend_folded``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from specserve.platform.cpu import (
    avx2_gemm,
    draft_levels,
    draft_topk,
    elementwise,
    fused_layer,
    int8_gemm,
    native,
    race_walk,
    small_gemm,
    tree_attention,
    upcast_probe,
)
from specserve.platform.cpu.cpus import physical_ram_bytes, usable_cpus
from specserve.platform.cpu.governor import ThreadGovernor, batch_key
from specserve.platform.cpu.hugepages import place_on_huge_pages
from specserve.platform.cpu.malloc import HeapTrimmer, tune_malloc
from specserve.platform.cpu.mixed_probe import choose_crossover
from specserve.platform.cpu.one_row_probe import choose_one_row_kernel
from specserve.platform.cpu.packing import (
    FP32_MAX_ROWS,
    MixedLinear,
    PackedLinear,
    UpcastLinear,
    avx2_linears_for_cpu,
    mix_linears_for_cpu,
    pack_linears_for_cpu,
    packable_bytes,
    upcast_linears_for_cpu,
)
from specserve.platform.cpu.upcast_probe import choose_upcast_rows
from specserve.platform.policy import PlatformPolicy
from specserve.sampling import race

HALF_DTYPES = (torch.bfloat16, torch.float16)

#: A float32 draft with MixedLinears keeps its KV in this dtype and runs its forwards of more rows than its linears'
#: crossover (``mixed_probe.py``) in it (``EagleProposer.compute_dtype``): at batch 32 its catch-ups gather half the
#: bytes and its prompt catch-up runs on half-size activations (docs/benchmarks.md); smaller forwards (on the Xeon,
#: batch-1 tree levels and extends) stay float32.
HALF_DRAFT_DTYPE = torch.bfloat16

#: ``_attend_folded`` is used for half-precision queries on CPU from this many requests and up to FOLD_MAX_Q query
#: rows each (docs/benchmarks.md: 17-32% less SDPA time for 8-32 requests of 2-8 rows in bf16; at 1-2 requests
#: or in float32 the kernel's own grouping is as fast or faster, so they keep it)
FOLD_MIN_BATCH = 4
FOLD_MAX_Q = 16


#: Packed linears keep their plain weights for one-row calls (``packing.cpu_gemv``: batch-1 decode at up to twice
#: the packed kernel's speed, on CPUs where the probe finds it faster: ``one_row_probe.py``) when that extra copy
#: takes at most this share of the machine's memory. SmolLM2-135M keeps 214 MB (its tied LM head costs nothing); a 7B
#: model's 13 GB copy is left out on machines under 104 GB.
PLAIN_COPY_MAX_MEMORY_SHARE = 1 / 8

#: set to 1 to keep the weights where they were loaded instead of moving them onto huge pages (``hugepages.py``;
#: for A/B measurements)
KEEP_WEIGHT_PAGES_ENV = "SPECSERVE_KEEP_WEIGHT_PAGES"


class CpuPolicy(PlatformPolicy):
    def __init__(self, args, device: torch.device) -> None:
        super().__init__(args, device)
        self.governor: ThreadGovernor | None = None  # set by configure_threads when the count adapts
        self.trimmer: HeapTrimmer | None = None  # set by tune_allocator when the heap is kept
        self.one_row: dict[str, dict] = {}  # packed module's class name -> its one-row kernel verdict
        self.small_rows: dict[str, dict] = {}  # packed module's class name -> the few-row kernel's verdict
        self.mixed: dict | None = None  # the float32 draft linears' crossover verdict, once a draft is mixed
        self.upcast: dict[str, dict] = {}  # module's class name -> its half-precision linears' float32-copy verdict
        self.huge_page_bytes = 0  # weights moved onto huge pages (hugepages.py), all models together
        self.int8_linears = 0  # int8 quantized linears on specserve's int8 kernel (int8_gemm.py), all models
        self.avx2_linears = 0  # bf16 linears on specserve's AVX2 kernel (avx2_gemm.py), all models
        # specserve's few-query attention kernel (tree_attention.py), unless SPECSERVE_CPU_ATTENTION=off
        self.tree_attention = device.type == "cpu" and tree_attention.available()
        # RMSNorm, SiLU-and-multiply and RoPE in one call each (elementwise.py), unless SPECSERVE_CPU_ELEMENTWISE=off
        self.elementwise = device.type == "cpu" and elementwise.available()
        self.fused_modules = 0  # modules given those operators, all models together
        self.fused_layers = 0  # decoder layers run as one operator call (fused_layer.py), all models together
        if device.type == "cpu" and native.native_ops():
            race.use_kernel(elementwise.race_exponentials)  # seeded sampling's noise without a first-request compile

    @property
    def packs_weights(self) -> bool:
        """oneDNN-packed linears unless ``--disable-cpu-weight-packing``."""
        return not self.args.disable_cpu_weight_packing

    # ------------------------------------------------------------------ the process
    def tune_allocator(self) -> bool:
        """glibc malloc keeps freed activation buffers, and a HeapTrimmer hands its free holes back now and then
        (``malloc.py``)."""
        tuned = tune_malloc()
        self.trimmer = HeapTrimmer() if tuned else None
        return tuned

    def upkeep(self, idle: bool) -> None:
        if self.trimmer is not None:
            self.trimmer.tick(idle)

    @property
    def adapts_threads(self) -> bool:
        """Whether the thread count follows contention (``governor.py``): not when ``--num-threads`` forces a
        count; not under ``--enable-torch-compile`` with graphs built up front, whose generated kernels fix their
        thread count when built (``--torch-compile-in-background`` builds a graph per count, as its calls meet
        them); not under tensor parallelism, whose ranks each keep their own share of the cores."""
        compiled_up_front = self.args.enable_torch_compile and not self.args.torch_compile_in_background
        return not self.args.num_threads and not compiled_up_front and self.args.tp_size == 1

    def configure_threads(self) -> None:
        """``--num-threads``, else the CPUs this process may use (``cpus.py``: affinity and cgroup quota), which the
        governor then lowers while other processes keep cores busy."""
        threads = self.args.num_threads or usable_cpus()
        self.fix_threads(threads)
        self.governor = ThreadGovernor(threads) if self.adapts_threads else None

    def thread_target(self) -> int:
        return self.governor.threads if self.governor is not None else super().thread_target()

    def thread_counts(self) -> tuple[int, ...]:
        return self.governor.levels if self.governor is not None else super().thread_counts()

    def fix_threads(self, threads: int) -> None:
        self.governor = None
        super().fix_threads(threads)

    def apply_threads(self) -> None:
        # torch.set_num_threads sets the calling thread's OpenMP count: the scheduler thread and the overlap
        # scheduler's forward thread each apply the governor's count before they run forwards
        if self.governor is not None and torch.get_num_threads() != self.governor.threads:
            torch.set_num_threads(self.governor.threads)

    def time_step(self, batch_size: int, seconds: float) -> None:
        if self.governor is not None:
            self.governor.observe(batch_key(batch_size), seconds)

    def info(self) -> dict:
        extra = {"cpu_heap_trims": self.trimmer.trims} if self.trimmer is not None else {}
        if self.one_row:
            extra["cpu_one_row_kernel"] = self.one_row
        if self.small_rows:
            extra["cpu_small_gemm"] = self.small_rows
        if self.mixed is not None:
            extra["cpu_draft_fp32_rows"] = self.mixed
        if self.upcast:
            extra["cpu_upcast_linears"] = self.upcast
        if self.tree_attention:
            extra["cpu_tree_attention"] = True
        if self.int8_linears:
            extra["cpu_int8_gemm_linears"] = self.int8_linears
        if self.avx2_linears:
            extra["cpu_avx2_gemm_linears"] = self.avx2_linears
        if self.fused_modules:
            extra["cpu_fused_elementwise_modules"] = self.fused_modules
        if self.fused_layers:
            extra["cpu_fused_layers"] = self.fused_layers
        if self.small_rows or self.tree_attention or self.int8_linears or self.fused_modules:
            extra["cpu_ops_in_cpp"] = native.native_ops()  # the kernels' operators run their C++ implementations
        if self.huge_page_bytes:
            extra["cpu_weights_on_huge_pages_mib"] = round(self.huge_page_bytes / 2**20, 1)
        if self.governor is not None:
            return {"cpu_threads_adaptive": True, **self.governor.info(), **extra}
        return {"cpu_threads_adaptive": False, "cpu_threads": torch.get_num_threads(), **extra}

    # ------------------------------------------------------------------ weights
    def pack_weights(self, module: nn.Module) -> int:
        """bf16/fp16 linears -> oneDNN-packed ``PackedLinear`` (``packing.py``), keeping their plain weights for
        one-row calls where that copy is small enough (``keeps_plain_weights``) and gemv is the faster one-row kernel
        for them on this machine (``one_row_probe.py``), and a copy for specserve's few-row kernel for the row counts
        where it is faster still (``small_gemm.py``; same size rule). Where oneDNN packs nothing (no AVX512), bf16
        linears run on specserve's AVX2 kernel instead (``avx2_gemm.py``), and the half-precision ones left on a
        float32 copy if SPECSERVE_CPU_UPCAST asks for it (``upcast_linears``). Then the weights move onto huge pages
        (``place_weights``). Before that, int8 quantized linears hand their few-row calls to specserve's int8 kernel
        (``int8_gemm.py``), and its norms, SiLU gated MLPs and rotary embeddings get one-call operators for their
        eager bf16 forwards (``elementwise.py``). Last, decoder layers whose every piece then runs on those kernels
        become one operator call for such forwards (``fused_layer.py``)."""
        if self.elementwise:
            self.fused_modules += elementwise.use_fused_ops(module)
        self.int8_linears += int8_gemm.use_int8_kernel(module)
        keep = self.keeps_plain_weights(module)
        small = self.packs_weights and keep and small_gemm.available()
        packed = pack_linears_for_cpu(module, keep_plain=keep, keep_small=small) if self.packs_weights else 0
        if self.packs_weights and not packed:  # a CPU without AVX512: oneDNN packs no half-precision weight
            packed = self.avx2_kernel_linears(module)
            self.upcast_linears(module)  # the half-precision linears left (fp16 ones, odd shapes), if asked for
        kept = [m for m in module.modules() if isinstance(m, PackedLinear) and m.plain is not None]
        if kept:  # gemv or the packed kernel for one row: whichever is faster here (one_row_probe.py)
            self.one_row[type(module).__name__] = choose_one_row_kernel(kept)
        with_small = [m for m in module.modules() if isinstance(m, PackedLinear) and m.small is not None]
        if with_small:  # up to how many rows specserve's own kernel beats those (small_gemm.py)
            whole_layers = self.elementwise and self.tree_attention and fused_layer.available() and any(
                fused_layer.fusable(m) for m in module.modules())
            self.small_rows[type(module).__name__] = small_gemm.choose_small_rows(with_small, whole_layers)
        self.place_weights(module)  # after the probe, which may drop the plain copies: no mapping holds them then
        with_small = [m for m in with_small if m.small is not None]
        if with_small:  # the kernel's software prefetch, timed on the weights where they now are (small_gemm.py)
            prefetch = small_gemm.choose_prefetch(with_small)
            if prefetch is not None:
                self.small_rows[type(module).__name__]["prefetch"] = prefetch
        if self.elementwise and self.tree_attention:
            self.fused_layers += fused_layer.use_fused_layers(module)
        return packed

    def decode_rows(self, model: nn.Module) -> int | None:
        """Where the model's decoder layers run as one operator call each (``fused_layer.py``): the rows their few-row
        kernels take (16 on the vector loop, 64 on the tile unit); past them a layer runs its modules, about 2.5x the
        time of a demo decode step at batch 16 on a 2-core AMD EPYC."""
        rows = [layer.fused.max_rows() for layer in model.modules()
                if isinstance(getattr(layer, "fused", None), fused_layer.FusedLayer)]
        return min(rows) if rows and min(rows) > 0 else None

    def avx2_kernel_linears(self, module: nn.Module) -> int:
        """Where oneDNN packed none of module's half-precision linears, its bf16 ones run on specserve's AVX2 kernel
        (``avx2_gemm.py``) where it builds, unless SPECSERVE_CPU_AVX2_GEMM=off -> how many."""
        if not avx2_gemm.available():
            return 0
        count = avx2_linears_for_cpu(module)
        self.avx2_linears += count
        return count

    def upcast_linears(self, module: nn.Module) -> None:
        """Where oneDNN packed none of module's half-precision linears (a CPU without AVX512) and SPECSERVE_CPU_UPCAST
        asks for it (auto or on), each gets a float32 copy of its weight for calls of several rows, where the probe
        finds it faster (``upcast_probe.py``), if the copies fit in PLAIN_COPY_MAX_MEMORY_SHARE of the memory."""
        if upcast_probe.mode() == "off":
            return
        if 2 * packable_bytes(module) > PLAIN_COPY_MAX_MEMORY_SHARE * (physical_ram_bytes() or 0):
            return
        upcast_linears_for_cpu(module)
        linears = [m for m in module.modules() if isinstance(m, UpcastLinear)]
        if linears:
            self.upcast[type(module).__name__] = choose_upcast_rows(linears)

    def kv_store(self):
        """specserve's one-call K and V write (``elementwise.kv_store``) where the element-wise operators run."""
        return elementwise.kv_store if self.elementwise else None

    def place_weights(self, module: nn.Module) -> None:
        """The module's weights onto huge pages (``hugepages.py``) unless KEEP_WEIGHT_PAGES_ENV is set."""
        if os.environ.get(KEEP_WEIGHT_PAGES_ENV, "") in ("", "0"):
            self.huge_page_bytes += place_on_huge_pages(module)

    @staticmethod
    def keeps_plain_weights(module: nn.Module) -> bool:
        """The plain copy of module's packable linears fits in PLAIN_COPY_MAX_MEMORY_SHARE of the memory (never
        where the OS does not say how much there is)."""
        return packable_bytes(module) <= PLAIN_COPY_MAX_MEMORY_SHARE * (physical_ram_bytes() or 0)

    # ------------------------------------------------------------------ draft models
    def mixed_linears(self, draft_dtype: torch.dtype, target_dtype: torch.dtype) -> bool:
        """A float32 draft under a half-precision target gets MixedLinears (packed bf16 for large calls), unless
        packing is off."""
        return self.packs_weights and draft_dtype == torch.float32 and target_dtype in HALF_DTYPES

    def mix_linears(self, module: nn.Module) -> int:
        """float32 linears -> ``MixedLinear`` (``packing.py``), float32 up to the crossover the first mixed module
        measured on this machine (``mixed_probe.py``), packed bf16 above it."""
        count = mix_linears_for_cpu(module, keep_small=small_gemm.available())
        mixed = [m for m in module.modules() if isinstance(m, MixedLinear)]
        with_small = [m for m in mixed if m.small is not None]
        if with_small:  # the bf16 path's few-row calls: specserve's kernel where it beats the packed one
            self.small_rows[type(module).__name__] = small_gemm.choose_small_rows(with_small)
        if mixed and self.mixed is None:
            self.mixed = choose_crossover(mixed)
        for m in mixed:
            m.fp32_max_rows = self.fp32_max_rows
        return count

    @property
    def fp32_max_rows(self) -> int:
        """A mixed draft's calls of up to this many rows run in float32 (the measured crossover, else the default)."""
        return FP32_MAX_ROWS if self.mixed is None else self.mixed["fp32_max_rows"]

    def draft_kv_dtype(self, draft_dtype: torch.dtype, target_dtype: torch.dtype) -> torch.dtype:
        """HALF_DRAFT_DTYPE for a float32 draft with MixedLinears, else the draft's own."""
        return HALF_DRAFT_DTYPE if self.mixed_linears(draft_dtype, target_dtype) else draft_dtype

    def runs_half_precision(self, rows: int) -> bool:
        """Calls of more rows than the mixed linears' crossover (``fp32_max_rows``): prompt catch-ups, and at a large
        batch the catch-ups and tree levels (with a crossover of 0, every call). Their matmuls run packed bf16
        anyway, so the activations between them stay half-size and unconverted; smaller calls keep float32, where
        the probe found it faster."""
        return rows > self.fp32_max_rows

    # ------------------------------------------------------------------ attention
    def folds_query_heads(self, qb: torch.Tensor, n_kv: int, masked: bool) -> bool:
        """Half-precision CPU queries with GQA and a mask, from FOLD_MIN_BATCH requests of up to FOLD_MAX_Q rows."""
        bsz, max_q, n_heads, _ = qb.shape
        return (qb.device.type == "cpu" and qb.dtype in HALF_DTYPES and n_heads > n_kv and masked
                and bsz >= FOLD_MIN_BATCH and max_q <= FOLD_MAX_Q)

    def head_ranker(self, norm: nn.Module, lm_head: nn.Module | None):
        """The ``draft_topk`` operator (``draft_topk.py``) where the decoder layers fuse here and the head's LM head
        runs on a few-row kernel."""
        if not (self.elementwise and self.tree_attention):
            return None
        return draft_topk.HeadTopk.for_head(norm, lm_head)

    def race_walk(self):
        """The ``race_walk`` operator (``race_walk.py``) where ``ops.cpp`` registered it, for CPU tensors."""
        if self.device.type != "cpu" or not (native.native_ops() and race_walk.native()):
            return None
        return race_walk.race_walk

    def head_levels(self, layer_hook, ranker, embedding: nn.Module | None):
        """The ``draft_levels`` operator (``draft_levels.py``) where the head's layer runs ``decoder_layer`` and its
        ranking ``draft_topk``."""
        if not (self.elementwise and self.tree_attention):
            return None
        return draft_levels.HeadLevels.for_head(layer_hook, ranker, embedding)

    def few_query_attention(self, qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor):
        """specserve's kernel (``tree_attention.py``) for bf16 queries, up to its MAX_QUERIES per request; inside a
        compiled graph through its custom op. A compiled graph's decode rows keep their fused loops
        (``_attend_one_query_by_slot``, chosen before this is asked)."""
        if not self.tree_attention or not tree_attention.takes(qb, k_buf, v_buf):
            return None
        return tree_attention.tree_attention_op if torch.compiler.is_compiling() else tree_attention.tree_attention
