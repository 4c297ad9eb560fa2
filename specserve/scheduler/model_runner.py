"""ModelRunner: the loaded model, its KV pools, and how big they are.

KV capacity comes from ``--max-total-tokens`` when given; otherwise from ``--mem-fraction-static`` of the
device's memory (on CUDA the total device memory, on CPU ``--cpu-memory-budget-gb``) minus the weights.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from specserve.attention import ForwardBatch, create_attention_backend
from specserve.attention.backend import ATTENTION_BACKENDS
from specserve.cache.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from specserve.config import ConfigError, ServerArgs
from specserve.models.compile import BackgroundCompiler, CompileStats, compile_forward
from specserve.models.compile_warm import start_cache_warmer
from specserve.models.cuda_graph import CudaGraphs, graph_backend
from specserve.models.gguf import source_file
from specserve.models.gguf_quant import apply_gguf_quantization
from specserve.models.llama import ModelOutput
from specserve.models.loader import load_model
from specserve.models.quantize import QuantLinear, parse_torchao_config, quantize_linears
from specserve.parallel.ranks import Leader
from specserve.platform import PlatformPolicy, platform_policy
from specserve.speculative.registry import draft_memory, lookahead

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = 0.85
MIN_KV_TOKENS = 64


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


class ModelRunner:
    @torch.inference_mode()  # weights and pools are inference tensors (as in Scheduler, which usually builds us)
    def __init__(self, args: ServerArgs, platform: PlatformPolicy | None = None) -> None:
        """platform: the process's tuning policy, made at start-up (default: the one for args.device); every part
        that loads, sizes or runs models reads it here, as ``runner.platform``."""
        self.args = args
        if args.node_rank > 0:
            raise ConfigError(f"--node-rank {args.node_rank}: only node 0 runs the engine; the other nodes run "
                              "`specserve serve --node-rank N ...`, which serves nothing and runs their ranks")
        self.platform = platform or platform_policy(args, resolve_device(args.device))
        self.device = self.platform.device
        # tensor parallelism: the other ranks start loading beside us; this process is rank 0 (pinned to its share
        # of the cores before the thread count is read from them)
        self.tp_leader = Leader(args) if args.tp_size > 1 else None
        self.platform.configure_threads()
        self.model, self.spec, self.model_dir = load_model(
            args.model_path, args.dtype, self.device, load_format=args.load_format, seed=args.random_seed,
            tp=self.tp_leader.group if self.tp_leader is not None else None)
        self.dtype = next(self.model.parameters()).dtype
        self.gguf_linears: dict | None = None  # --quantization gguf: linears per kind (GGUFLinears.summary)
        self._quantize()
        # the weights as they are held: a quantized linear's integer weights beside its dense copy
        self._weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            m.integer_bytes() for m in self.model.modules() if isinstance(m, QuantLinear))
        self.platform.pack_weights(self.model)
        self.decode_rows = self.platform.decode_rows(self.model)  # PlainDecode.rows: None = no limit
        # an SGLang GPU backend name was accepted with a warning at start-up: it runs on the default backend
        backend = args.attention_backend if args.attention_backend in ATTENTION_BACKENDS else None
        self.attn_backend = create_attention_backend(backend, self.platform)
        self.compile_stats = CompileStats() if args.enable_torch_compile else None
        self.cuda_graphs = self._cuda_graphs()
        self.background_compiler = self._background_compiler()
        self.speed_up_forward(self.model.model)  # the decoder stack; the LM head stays eager
        self.context_len = self._context_len()
        args.resolve_speculative_defaults(self.spec.architecture)
        # speculation writes a draft tree / verify nodes past a request's last position
        self.lookahead = lookahead(args)
        self.model.set_max_positions(self.context_len + self.lookahead + 8)
        self.draft_memory = draft_memory(args, self.spec, self.dtype, self.platform)
        self.max_total_tokens = self._kv_capacity()
        self._start_cache_warmer()
        self.max_running_requests = args.effective_max_running_requests
        self.kv_pool = KVPool(self.spec.num_layers, self.max_total_tokens, self.kv_heads, self.spec.head_dim,
                              self.dtype, self.device, self.platform.kv_store())
        if self.tp_leader is not None:
            self.tp_leader.setup(self.max_total_tokens, self.context_len + self.lookahead + 8)
        self.allocator = SlotAllocator(self.max_total_tokens, self.device)
        # +1 row so a retracted-and-resumed request never waits for a row while others hold them all
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1, self.context_len + self.lookahead + 8, self.device)
        self.eos_token_ids = self._eos_ids()
        window = self.spec.raw.get("sliding_window")
        if window and self.spec.raw.get("use_sliding_window", True) and window < self.context_len:
            logger.warning("sliding_window=%d is not implemented: attention is full up to the context length", window)
        logger.info(
            "loaded %s (%s, %s) on %s: context %d, KV capacity %d tokens",
            self.spec.architecture, self.model_dir, self.dtype, self.device, self.context_len,
            self.max_total_tokens,
        )

    # ------------------------------------------------------------------
    def _quantize(self) -> None:
        """--torchao-config: the target's linears -> weight-only int8 / int4 (``models/quantize.py``); --quantization
        gguf: rebuilt from the GGUF file's blocks (``models/gguf_quant.py``). Before the weights are packed (a
        quantized linear's dense copy is packed like any linear)."""
        if self.args.quantization == "gguf":
            self._gguf_blocks()
            return
        quant = parse_torchao_config(self.args.torchao_config)
        if quant is None:
            return
        if self.device.type != "cpu":
            raise ConfigError(f"--torchao-config {quant.name} runs on CPU only (PyTorch's CPU int8 / int4 kernels); "
                              f"this engine runs on {self.device.type}")
        quantize_linears(self.model, quant)

    def _gguf_blocks(self) -> None:
        if self.device.type != "cpu":
            logger.info("--quantization gguf on %s: the GGUF file's weights run dequantized to %s (the 4-bit kernel "
                        "is PyTorch's CPU one)", self.device.type, self.dtype)
            return
        gguf_file = source_file(self.args.model_path)
        if gguf_file is None:
            raise ConfigError(f"--quantization gguf: {self.args.model_path!r} is neither a GGUF file nor a folder "
                              "converted from one")
        self.gguf_linears = apply_gguf_quantization(self.model, self.spec, gguf_file).summary()

    def speed_up_forward(self, module: nn.Module) -> nn.Module:
        """Wrap module.forward(fb, *tensors) in the forward speed-ups in force: torch.compile, then CUDA graphs
        around the compiled forward. For the target's decoder stack and each proposer's draft modules."""
        if self.compile_stats is not None:
            compile_forward(module, self.args.torch_compile_max_bs, self.compile_stats, self.background_compiler)
        if self.cuda_graphs is not None:
            self.cuda_graphs.wrap(module)
        return module

    def _background_compiler(self) -> BackgroundCompiler | None:
        if self.compile_stats is None or not self.args.torch_compile_in_background:
            return None
        if self.cuda_graphs is not None:  # a graph captured around an eager forward would never see the compiled one
            logger.info("--torch-compile-in-background ignored with CUDA graphs: the graphs are built at start-up")
            return None
        return BackgroundCompiler(self.compile_stats, self.platform.thread_target, self.platform.thread_counts())

    def _start_cache_warmer(self) -> None:
        """Background compile on CPU: a niced child process fills torch.compile's cache before this process builds
        anything (``models/compile_warm.py``), unless a child did so already for these settings."""
        if (self.background_compiler is not None and self.device.type == "cpu"
                and not self.args.disable_torch_compile_warmer):
            self.background_compiler.warmer = start_cache_warmer(self.args, self.max_total_tokens)

    def _cuda_graphs(self) -> CudaGraphs | None:
        if self.tp_leader is not None:
            return None  # the followers replay nothing: they run each forward eagerly
        backend = graph_backend(self.device, self.args.disable_cuda_graph)
        if backend is None:
            if self.args.cuda_graph_max_bs is not None and self.device.type != "cuda":
                logger.info("--cuda-graph-max-bs ignored: CUDA graphs need a CUDA device (this is %s)", self.device)
            return None
        graphs = CudaGraphs(backend, self.args.effective_cuda_graph_max_bs, self.device)
        logger.info("CUDA graphs (%s): decode, verify and draft forwards of up to %d requests, captured on first use",
                    backend, graphs.max_bs)
        return graphs

    def _context_len(self) -> int:
        ctx = self.args.context_length or self.spec.max_position_embeddings
        if self.args.context_length and self.args.context_length > self.spec.max_position_embeddings:
            logger.warning(
                "--context-length %d exceeds the model's max_position_embeddings %d",
                self.args.context_length, self.spec.max_position_embeddings,
            )
        return ctx

    def info(self) -> dict:
        """The CPU thread count (``platform``) and the forward speed-ups' counters (torch.compile, CUDA graphs) for
        the server info; the speed-ups' are absent when off."""
        info = {**self.platform.info(), **(self.tp_leader.info() if self.tp_leader is not None else {"tp_size": 1})}
        cs = self.compile_stats
        if cs is not None:
            info.update(torch_compile_graphs=cs.graphs, torch_compile_seconds=cs.seconds,
                        torch_compile_calls=cs.compiled_calls)
            if cs.background:
                info.update(torch_compile_eager_calls=cs.eager_calls, torch_compile_kinds_built=cs.kinds_built,
                            torch_compile_kinds_pending=cs.kinds_pending, torch_compile_kinds_failed=cs.kinds_failed,
                            torch_compile_warming_cache=self.background_compiler.warming(),
                            torch_compile_kinds_by_threads=self.background_compiler.kinds_by_threads())
        if self.gguf_linears is not None:
            info.update(gguf_linears=self.gguf_linears)
        graphs = self.cuda_graphs
        if graphs is not None:
            st = graphs.stats
            info.update(cuda_graph=graphs.backend, cuda_graph_max_bs=graphs.max_bs, cuda_graph_graphs=st.graphs,
                        cuda_graph_capture_seconds=st.capture_seconds, cuda_graph_replays=st.replays,
                        cuda_graph_eager_calls=st.eager_calls, cuda_graph_capture_failures=st.capture_failures)
        return info

    def weight_bytes(self) -> int:
        return self._weight_bytes

    def _kv_capacity(self) -> int:
        """KV slots: --max-total-tokens, else what the memory budget leaves after the weights, a slot costing the
        target's KV plus the drafter's (its pool has one slot per target slot) and the budget paying the draft's
        weights too."""
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        per_token = KVPool.bytes_per_token(self.spec.num_layers, self.kv_heads, self.spec.head_dim, self.dtype)
        per_token += self.draft_memory.kv_bytes_per_token
        frac = self.args.mem_fraction_static or DEFAULT_MEM_FRACTION
        if self.device.type == "cuda":  # free memory now + what the weights took = what was free before them
            total = torch.cuda.mem_get_info(self.device)[0] + self.weight_bytes()
        else:
            total = int(self.args.cpu_memory_budget_gb * 2**30)
        budget = int(total * frac) - self.weight_bytes() - self.draft_memory.weight_bytes
        tokens = budget // per_token
        if tokens < MIN_KV_TOKENS:
            raise ConfigError(
                f"--mem-fraction-static {frac} leaves room for only {max(tokens, 0)} KV tokens after the "
                f"weights ({(self.weight_bytes() + self.draft_memory.weight_bytes) / 2**30:.2f} GiB, draft "
                "included); raise it or set --max-total-tokens"
            )
        # never more than every running request at full context could use
        return int(min(tokens, self.args.effective_max_running_requests * self._context_len() + 1))

    def _eos_ids(self) -> set[int]:
        ids = set(self.spec.eos_token_ids)
        gen_cfg = os.path.join(self.model_dir, "generation_config.json")
        if os.path.isfile(gen_cfg):
            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        return ids

    @property
    def kv_heads(self) -> int:
        """KV heads this process keeps (its share under tensor parallelism)."""
        return self.model.model.layers[0].self_attn.num_kv_heads if self.spec.num_layers else self.spec.num_kv_heads

    # ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ModelOutput:
        if self.tp_leader is not None:
            self.tp_leader.forward(fb)  # the other ranks run it with us
        return self.model(fb)

    def close(self) -> None:
        """Stop the background compiles and the other tensor-parallel ranks."""
        if self.background_compiler is not None:
            self.background_compiler.close()
        if self.tp_leader is not None:
            self.tp_leader.close()
