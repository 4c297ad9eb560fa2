"""ServerArgs: the one configuration object of specserve.

Every knob of the engine, the server and the command line is a field here, with SGLang's name. The
command line (``specserve.args``, used by ``specserve.cli`` and ``launch_server``) is generated from these fields,
and ``validate()`` is the single place where values are checked, so a bad value fails at start-up with a message
naming the flag.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from specserve.flags import (
    AUTO_OFF_ENV,
    SPEC_V2_ENV,
    SPEC_V2_NAMES,
    ConfigError,
    env_flag,
    flag_name,
    require_choice,
    require_positive,
)
from specserve.grammar.backend import DEFAULT_GRAMMAR_BACKEND, check_grammar_backend
from specserve.models.quantize import parse_torchao_config
from specserve.tools.formats import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")  # --load-balance-method (SGLang's names)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# SGLang's --attention-backend values for its GPU kernel libraries, which are not part of specserve: accepted (with
# a warning) and run on the default backend. specserve's own are ``specserve.attention.backend.ATTENTION_BACKENDS``.
SGLANG_ATTENTION_BACKENDS = ("fa3", "fa4", "flashinfer", "triton", "flashmla", "cutlass_mla", "trtllm_mla",
                             "trtllm_mha", "aiter", "wave", "ascend", "intel_amx", "intel_xpu", "dual_chunk_flash_attn")
#: --speculative-draft-score-temperature upper bound: far above 1 every candidate scores alike (no use)
MAX_SCORE_TEMPERATURE = 10.0
__all__ = ["ConfigError", "ServerArgs", "env_flag", "flag_name", "SPEC_V2_ENV", "SPEC_V2_NAMES"]


@dataclass
class ServerArgs:
    # --- model and tokenizer ---
    model_path: str | None = field(default=None, metadata={"help": "HF-format model folder (or cached hub id)."})
    tokenizer_path: str | None = field(default=None, metadata={"help": "Tokenizer folder; defaults to the model."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code in HF configs."})
    dtype: str = field(default="auto", metadata={"help": "auto|float32|float16|bfloat16 (auto = checkpoint's)."})
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda (auto = cuda when available)."})
    load_format: str = field(
        default="auto",
        metadata={"help": "auto|safetensors|gguf: read the checkpoint (auto: an HF folder, or a .gguf file converted "
                          "once into a cached HF folder; gguf: the model path must be one); dummy: random weights "
                          "from config.json only (seeded; for benchmarks; also applied to the draft model)."},
    )
    context_length: int | None = field(default=None, metadata={"help": "Max prompt+output tokens per request."})
    served_model_name: str | None = field(default=None, metadata={"help": "Model name reported by the API."})
    chat_template: str | None = field(default=None, metadata={"help": "Jinja chat template file or string."})
    random_seed: int = field(default=0, metadata={"help": "Base seed for requests that give none."})
    # --- memory and scheduling ---
    mem_fraction_static: float | None = field(
        default=None, metadata={"help": "Fraction of device memory for weights + KV cache (default 0.85)."}
    )
    cpu_memory_budget_gb: float = field(
        default=8.0, metadata={"help": "On CPU: the memory budget that --mem-fraction-static is a fraction of."}
    )
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV cache capacity in tokens."})
    max_running_requests: int | None = field(
        default=None, metadata={"help": "Max requests decoding at once (default 256; 48 with speculation)."}
    )
    max_queued_requests: int | None = field(default=None, metadata={"help": "Max waiting requests (None: no cap)."})
    chunked_prefill_size: int = field(
        default=2048, metadata={"help": "Max prompt tokens prefilled per step; -1 disables chunking."}
    )
    max_prefill_tokens: int = field(default=16384, metadata={"help": "Max tokens in one prefill batch."})
    schedule_policy: str = field(default="fcfs", metadata={"help": "fcfs | lpm (longest prefix match first)."})
    disable_radix_cache: bool = field(default=False, metadata={"help": "Turn off prefix (radix) KV reuse."})
    enable_mixed_chunk: bool = field(default=False, metadata={
        "help": "Run the running requests' decode tokens in the same forward as a prefill chunk (no speculation)."})
    # --- server ---
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=30000, metadata={"help": "Port to listen on."})
    api_key: str | None = field(default=None, metadata={
        "help": "Require this bearer key on every request except /health and /metrics. Several keys, comma-separated, "
                "are separate clients: a request can be aborted only with the key that made it."})
    admin_api_key: str | None = field(default=None, metadata={
        "help": "The key for the admin endpoints (/flush_cache, /abort_request with abort_all or another client's "
                "rid) and for paths and pids in /get_server_info and /v1/models. It also opens every client endpoint. "
                "Unset: the --api-key holders are admins (no key at all: everyone)."})
    max_request_bytes: int = field(default=16 * 1024 * 1024, metadata={
        "help": "Largest request body in bytes; a larger one gets 413 before it is read."})
    max_request_samples: int = field(default=256, metadata={
        "help": "Most samples one request may ask for (prompts in a batch x n)."})
    max_stop_strings: int = field(default=64, metadata={"help": "Most stop strings per request."})
    max_stop_string_chars: int = field(default=512, metadata={"help": "Longest stop string, in characters."})
    max_top_logprobs: int = field(default=20, metadata={
        "help": "Most top logprobs per position a request may ask for (top_logprobs_num / top_logprobs)."})
    tokenizer_worker_num: int = field(default=4, metadata={
        "help": "Threads that tokenize, detokenize and render chat templates, off the server's event loop (SGLang's "
                "flag counts processes; here they are threads: the tokenizer releases the GIL)."})
    chat_template_timeout: float = field(default=5.0, metadata={
        "help": "Seconds a chat template may take to render one request; a slower one gets 400."})
    trust_request_chat_template: bool = field(default=False, metadata={
        "help": "Let requests bring their own Jinja chat template (chat_template_kwargs.chat_template). Off: such a "
                "request gets 400, since a template is code that runs in the server."})
    grammar_backend: str = field(default=DEFAULT_GRAMMAR_BACKEND, metadata={
        "help": "Grammar engine of structured outputs (json_schema, regex, ebnf, response_format): llguidance, "
                "xgrammar (SGLang's default; pip install 'specserve[xgrammar]') or none (structured outputs off)."})
    constrained_json_disable_any_whitespace: bool = field(default=False, metadata={
        "help": "JSON outputs of a json_schema / response_format take no whitespace beyond the separators (by "
                "default up to 24 whitespace characters may stand between two JSON tokens)."})
    disable_grammar_jump_forward: bool = field(default=False, metadata={
        "help": "Structured outputs: do not jump over the tokens a grammar forces (a JSON key, a closing brace). By "
                "default plain decoding appends them without a forward of their own, and speculative decoding appends "
                "them to the draft tree in place of the nodes the grammar forbids (outputs are the same either way)."})
    disable_grammar_aware_drafting: bool = field(default=False, metadata={
        "help": "Speculative decoding of structured outputs: the EAGLE family drafts blind to the grammar (only "
                "verification masks it, as other engines do), for A/B benchmarks (outputs are the same either way)."})
    disable_grammar_check_first: bool = field(default=False, metadata={
        "help": "Structured outputs: build every constrained token's mask before drawing it. By default a greedy, or "
                "sampled without top_k/top_p/min_p, token is drawn first and only checked, the mask built only where "
                "the grammar refuses it (outputs are the same either way)."})
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "How the model writes tool calls (SGLang's names): qwen25 (also qwen, hermes: <tool_call> JSON), "
                "llama3 or mistral. Default: the one the chat template writes, if it writes one of these."})
    graceful_shutdown_timeout: float = field(default=120.0, metadata={
        "help": "On SIGTERM/SIGINT: seconds in-flight requests may take to finish before they are cut; requests still "
                "sending their body are cut at once."})
    log_level: str = field(default="info", metadata={"help": "debug|info|warning|error|critical."})
    enable_metrics: bool = field(default=False, metadata={"help": "Serve Prometheus metrics at /metrics."})
    stream_interval: int = field(default=1, metadata={
        "help": "A streamed request gets its new tokens every N tokens (non-streaming ones: once, at the finish)."})
    # --- speed ---
    torchao_config: str = field(default="", metadata={
        "help": "Weight-only quantization of the target's linears on CPU: int8wo, or int4wo-<group> with group 32, "
                "64, 128 or 256 (SGLang's names; PyTorch's packed int8 / int4 matmuls for calls of a few rows, a "
                "dequantized copy for larger ones). Empty: none."})
    quantization: str | None = field(default=None, metadata={
        "help": "SGLang's checkpoint quantization method. gguf (a GGUF checkpoint, CPU): the file's 4-bit linears "
                "(Q4_0, Q4_1, Q4_K) run on the int4 kernel with the file's own blocks, its other linears dense in "
                "--dtype; without it a GGUF file runs dequantized to --dtype. Other methods are not supported."})
    enable_torch_compile: bool = field(default=False, metadata={
        "help": "Compile the decode, verify and draft forwards with torch.compile; their graphs are built at start-up "
                "by warm-up requests (unless --skip-server-warmup)."})
    torch_compile_in_background: bool = field(default=False, metadata={
        "help": "With --enable-torch-compile (which it turns on): ready at once, no warm-up requests; each kind of "
                "forward runs eager until a background thread has built its graph from its first call."})
    disable_torch_compile_warmer: bool = field(default=False, metadata={
        "help": "With --torch-compile-in-background on CPU: build the graphs in the server process from the start, "
                "instead of first leaving them to a low-priority child process that fills torch.compile's cache "
                "(the server decodes eager meanwhile, on one thread fewer)."})
    disable_torch_compile: bool = field(default=False, metadata={
        "help": "No torch.compile: the default model (`specserve serve` without --model-path) otherwise compiles "
                "in the background on a CPU with AVX512-BF16 (on one with only AVX2 its bf16 layers run fused, "
                "eager). Cannot be combined with --enable-torch-compile or --torch-compile-in-background."})
    torch_compile_max_bs: int = field(
        default=32, metadata={"help": "Batches with more requests than this run eager (with torch.compile)."})
    cuda_graph_max_bs: int | None = field(default=None, metadata={
        "help": "Batches above this run without CUDA graphs (default 32 with speculation, else 128)."})
    cuda_graph_bs: list[int] | None = field(default=None, metadata={
        "help": "SGLang's list of captured batch sizes: specserve captures lazily up to the largest of them (it sets "
                "--cuda-graph-max-bs)."})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "Turn off CUDA graphs."})
    attention_backend: str | None = field(default=None, metadata={
        "help": "torch_native (default; alias sdpa): PyTorch SDPA. SGLang's GPU kernel backends (fa3, flashinfer, "
                "triton, ...) are accepted with a warning and run on SDPA: the outputs are the same, not the speed."})
    page_size: int = field(default=1, metadata={
        "help": "Tokens per KV page. specserve's KV cache is token-granular (page size 1); a larger value is "
                "accepted with a warning and the cache stays token-granular (prefix reuse is then finer than asked)."})
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "Turn the overlap scheduler off even when SGLANG_ENABLE_SPEC_V2 / SPECSERVE_ENABLE_SPEC_V2 is set."})
    skip_server_warmup: bool = field(default=False, metadata={
        "help": "Skip the warm-up requests run at start-up under --enable-torch-compile (its graphs are then built "
                "during the first requests)."})
    disable_cpu_weight_packing: bool = field(
        default=False, metadata={"help": "Keep plain bf16/fp16 linears on CPU (no oneDNN pre-packing)."}
    )
    # --- scale-out (specserve.parallel) ---
    tp_size: int = field(default=1, metadata={
        "help": "Tensor parallelism: ranks the target model is sharded over (attention heads, MLP columns, "
                "vocabulary), one process each; on CPU each rank gets its own share of the cores (torch.distributed "
                "gloo; NCCL on CUDA, untested)."})
    nnodes: int = field(default=1, metadata={"help": "Nodes the --tp-size ranks are spread over (equally)."})
    node_rank: int = field(default=0, metadata={
        "help": "This node's index among --nnodes; node 0 serves, the others run their ranks only."})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port where the ranks meet (node 0's address; required with --nnodes > 1; default: a free "
                "local port)."})
    dp_size: int = field(default=1, metadata={
        "help": "Data parallelism: engine replicas in this server, each a worker process with its own model copy, KV "
                "cache and scheduler; requests go to one of them by --load-balance-method. On CPU each replica gets "
                "its own share of the cores (and --tp-size ranks within it)."})
    load_balance_method: str = field(default="round_robin", metadata={
        "help": "How requests are spread over --dp-size replicas: round_robin, or shortest_queue (the replica with "
                "the fewest requests in flight). A request's parallel samples (n) stay on one replica."})
    num_threads: int | None = field(default=None, metadata={
        "help": "CPU threads for torch, fixed. Default: the CPUs this process may use (affinity mask, cgroup CPU "
                "quota), lowered while other processes keep cores busy and raised again when they stop."})
    # --- speculative decoding (see docs/formats.md) ---
    speculative_algorithm: str | None = field(
        default=None,
        metadata={"help": "EAGLE | EAGLE3 | NEXTN | STANDALONE | NGRAM (or an algorithm a plugin registers)."}
    )
    speculative_draft_model_path: str | None = field(default=None, metadata={"help": "Draft model folder."})
    speculative_draft_model_revision: str | None = field(default=None, metadata={"help": "Draft revision."})
    speculative_draft_dtype: str = field(default="auto", metadata={
        "help": "auto|float32|float16|bfloat16: the dtype a separate draft model (EAGLE, EAGLE3, STANDALONE) runs "
                "in. auto = the target's. float32 under a bf16/fp16 target on CPU runs its small calls in float32 and "
                "the larger ones on packed bf16 copies. Outputs stay exact either way."})
    speculative_num_steps: int | None = field(default=None, metadata={"help": "Draft depth S."})
    speculative_eagle_topk: int | None = field(default=None, metadata={"help": "Branching per draft step K."})
    speculative_num_draft_tokens: int | None = field(
        default=None, metadata={"help": "Tree nodes verified per step N (root included)."}
    )
    speculative_accept_threshold_single: float = field(
        default=1.0, metadata={"help": "Lossy relaxation of sampling verification (1.0 = lossless)."}
    )
    speculative_accept_threshold_acc: float = field(
        default=1.0, metadata={"help": "Lossy relaxation of sampling verification (1.0 = lossless)."}
    )
    speculative_token_map: str | None = field(default=None, metadata={"help": "FR-Spec hot-token file."})
    speculative_draft_stop_threshold: float = field(default=0.0, metadata={
        "help": "EAGLE / EAGLE3 / NEXTN / STANDALONE: stop drafting deeper levels once every request's best live "
                "draft path has a cumulative draft probability below this (a shallower, cheaper tree; outputs "
                "stay exact). 0 = off. Drafting always stops once deeper levels cannot change the verified tree."})
    speculative_draft_score_temperature: float = field(default=1.0, metadata={
        "help": "EAGLE / EAGLE3 / NEXTN / STANDALONE, greedy requests: rank the draft tree's candidates by the "
                "draft's probabilities at this temperature (softmax(logits / T)). Below 1 they are sharpened toward "
                "greedy acceptance (a draft token is accepted when it is the target's argmax), which favours deeper "
                "trees. Sampled requests always use 1. Outputs never change, only which candidates are verified."})
    disable_speculative_coupled_drafting: bool = field(default=False, metadata={
        "help": "EAGLE / EAGLE3 / NEXTN / STANDALONE, sampled requests: rank draft candidates by the draft's own "
                "probabilities instead of by its race with the noise the request's verification will use (coupled "
                "drafting, the default at lossless thresholds). Outputs never change, only acceptance."})
    speculative_batch_token_budget: int = field(default=64, metadata={
        "help": "Batch-aware speculation: while batch x num_draft_tokens exceeds this, the draft tree shrinks to a "
                "chain of budget // batch nodes (off below 2); 0 = never shrink."})
    speculative_disable_batch_size: int | None = field(default=None, metadata={
        "help": "Batch-aware speculation: no speculation while more requests than this are running."})
    disable_speculative_auto_off: bool = field(default=False, metadata={
        "help": "Always speculate (within the two limits above) instead of measuring per batch size whether "
                "speculative or plain steps are faster and running the faster. Also turned on by the environment "
                "variable SPECSERVE_DISABLE_SPECULATIVE_AUTO_OFF=1."})
    enable_spec_v2: bool = field(default=False, metadata={
        "help": "Overlap scheduler for speculative decoding (topk 1 only): a step's output processing runs while "
                "the next step's draft and verify forwards run. Also turned on by the environment variable "
                "SPECSERVE_ENABLE_SPEC_V2=1 or SGLang's SGLANG_ENABLE_SPEC_V2=True."})
    speculative_ngram_min_match_window_size: int = field(default=1, metadata={"help": "NGRAM min match window."})
    speculative_ngram_max_match_window_size: int = field(default=12, metadata={"help": "NGRAM max match window."})
    speculative_ngram_min_bfs_breadth: int = field(default=1, metadata={"help": "NGRAM min BFS breadth."})
    speculative_ngram_max_bfs_breadth: int = field(default=10, metadata={"help": "NGRAM max BFS breadth."})
    speculative_ngram_match_type: str = field(default="BFS", metadata={"help": "NGRAM tree: BFS | PROB."})
    speculative_ngram_branch_length: int = field(default=18, metadata={"help": "NGRAM tokens inserted per step."})
    speculative_ngram_capacity: int = field(default=10_000_000, metadata={"help": "NGRAM trie node capacity."})

    # ------------------------------------------------------------------
    def validate(self) -> ServerArgs:
        """Check every field; raise ConfigError naming the flag. Returns self for chaining."""
        for name in ("dtype", "speculative_draft_dtype"):
            value = getattr(self, name)
            setattr(self, name, {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(value, value))
            require_choice(self, name, DTYPES)
        require_choice(self, "device", DEVICES)
        self.load_format = self.load_format.lower()
        require_choice(self, "load_format", LOAD_FORMATS)
        require_choice(self, "schedule_policy", SCHEDULE_POLICIES)
        self.log_level = self.log_level.lower()
        require_choice(self, "log_level", LOG_LEVELS)
        require_positive(self, "context_length", allow_none=True)
        require_positive(self, "max_total_tokens", allow_none=True)
        require_positive(self, "max_running_requests", allow_none=True)
        require_positive(self, "max_queued_requests", allow_none=True)
        require_positive(self, "max_prefill_tokens")
        require_positive(self, "torch_compile_max_bs")
        if self.disable_torch_compile and (self.enable_torch_compile or self.torch_compile_in_background):
            flag = "--torch-compile-in-background" if self.torch_compile_in_background else "--enable-torch-compile"
            raise ConfigError(f"--disable-torch-compile contradicts {flag}: give one of them")
        if self.torch_compile_in_background:
            self.enable_torch_compile = True
        require_positive(self, "cuda_graph_max_bs", allow_none=True)
        self._validate_sglang_only()
        self._validate_quantization()
        require_positive(self, "num_threads", allow_none=True)
        self._validate_parallel()
        require_positive(self, "stream_interval")
        self._validate_server_limits()
        if self.tool_call_parser is not None:
            require_choice(self, "tool_call_parser", tuple(TOOL_CALL_PARSERS))
        try:
            check_grammar_backend(self.grammar_backend)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ConfigError(f"--chunked-prefill-size must be -1 (off) or >= 1, got {self.chunked_prefill_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.cpu_memory_budget_gb <= 0:
            raise ConfigError(f"--cpu-memory-budget-gb must be > 0, got {self.cpu_memory_budget_gb}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        self._resolve_demo_names()
        self._validate_spec_v2()
        self.disable_speculative_auto_off = self.disable_speculative_auto_off or env_flag(AUTO_OFF_ENV)
        self._validate_speculative()
        if self.enable_mixed_chunk and self.speculative_algorithm is not None:
            logger.warning("--enable-mixed-chunk is turned off: speculative steps do not take a prefill chunk")
            self.enable_mixed_chunk = False
        return self

    def _validate_server_limits(self) -> None:
        for name in ("max_request_bytes", "max_request_samples", "max_stop_strings", "max_stop_string_chars",
                     "tokenizer_worker_num"):
            require_positive(self, name)
        if self.max_top_logprobs < 0:
            raise ConfigError(f"--max-top-logprobs must be >= 0, got {self.max_top_logprobs}")
        for name in ("chat_template_timeout", "graceful_shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{flag_name(name)} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and not all(k.strip() for k in value.split(",")):
                raise ConfigError(f"{flag_name(name)} has an empty key")
        if self.admin_api_key is not None and "," in self.admin_api_key:
            raise ConfigError("--admin-api-key takes one key")

    def _validate_quantization(self) -> None:
        try:
            quant = parse_torchao_config(self.torchao_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.torchao_config = quant.name if quant else ""
        if self.quantization is None:
            return
        self.quantization = self.quantization.lower()
        if self.quantization != "gguf":
            raise ConfigError(f"--quantization {self.quantization}: this checkpoint format is not supported; gguf "
                              f"is (a GGUF file, dequantized), and --torchao-config int8wo / int4wo-<group> "
                              f"quantizes a checkpoint's weights at load")
        if not (self.model_path or "").endswith(".gguf") and self.load_format not in ("auto", "gguf"):
            raise ConfigError(f"--quantization gguf needs a GGUF checkpoint; --load-format is {self.load_format}")
        if self.torchao_config:
            raise ConfigError(f"--quantization gguf runs the GGUF file's own quantized weights; --torchao-config "
                              f"{self.torchao_config} would quantize them again: pass one of the two")

    def _validate_sglang_only(self) -> None:
        """Flags SGLang's launch commands pass whose GPU machinery specserve does not have: checked, then mapped onto
        what specserve does, with a warning wherever the request cannot be met as asked."""
        require_positive(self, "page_size")
        if self.page_size != 1:
            logger.warning("--page-size %d: specserve's KV cache is token-granular (page size 1); using that",
                           self.page_size)
        if self.cuda_graph_bs is not None:
            if not self.cuda_graph_bs or any(not isinstance(b, int) or b < 1 for b in self.cuda_graph_bs):
                raise ConfigError(f"--cuda-graph-bs must be positive integers, got {self.cuda_graph_bs}")
            if self.cuda_graph_max_bs is None:
                self.cuda_graph_max_bs = max(self.cuda_graph_bs)
        from specserve.attention.backend import ATTENTION_BACKENDS

        backend = self.attention_backend
        if backend is not None and backend not in ATTENTION_BACKENDS:
            if backend not in SGLANG_ATTENTION_BACKENDS:
                raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)} (or an "
                                  f"SGLang GPU backend, which runs as torch_native here); got {backend!r}")
            logger.warning("--attention-backend %s: SGLang's kernel library is not part of specserve; attention runs "
                           "on PyTorch SDPA (torch_native)", backend)

    def _validate_parallel(self) -> None:
        for name in ("tp_size", "nnodes"):
            require_positive(self, name)
        if self.tp_size % self.nnodes:
            raise ConfigError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} (each node runs "
                              "as many ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--dist-init-addr (node 0's host:port) is required with --nnodes > 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--dist-init-addr must be host:port, got {self.dist_init_addr!r}")
        require_positive(self, "dp_size")
        require_choice(self, "load_balance_method", LOAD_BALANCE_METHODS)
        if self.dp_size > 1 and self.nnodes > 1:
            raise ConfigError("--dp-size > 1 runs its replicas on one node; it cannot be combined with --nnodes > 1")
        if self.tp_size > 1 and self.torchao_config:
            raise ConfigError("--torchao-config is not supported with --tp-size > 1")
        if self.tp_size > 1 and self.quantization == "gguf":
            raise ConfigError("--quantization gguf is not supported with --tp-size > 1 (its linears run dequantized "
                              "without the flag)")
        if self.tp_size > 1 and self.enable_torch_compile:
            flag = "--torch-compile-in-background" if self.torch_compile_in_background else "--enable-torch-compile"
            raise ConfigError(f"{flag} is not supported with --tp-size > 1 (the sharded forward's collectives run "
                              "eagerly)")

    def _validate_spec_v2(self) -> None:
        """The overlap scheduler: on by flag or environment (its topk 1 rule is the draft-tree algorithms')."""
        if self.disable_overlap_schedule:
            self.enable_spec_v2 = False
            return
        if not self.enable_spec_v2:
            self.enable_spec_v2 = env_flag(SPEC_V2_ENV)
        if not self.enable_spec_v2:
            return
        if self.speculative_algorithm is None:
            logger.warning("the overlap scheduler (%s) applies to speculative decoding only; ignored", SPEC_V2_NAMES)
            self.enable_spec_v2 = False

    def _resolve_demo_names(self) -> None:
        """``demo``, ``demo-eagle3``, ... name the code family (``specserve.demo_models``)."""
        from specserve.demo_models import resolve_demo

        if self.served_model_name is None and resolve_demo(self.model_path) != self.model_path:
            self.served_model_name = self.model_path  # the name the user typed ("demo"), not the package path
        for name in ("model_path", "tokenizer_path", "speculative_draft_model_path", "speculative_token_map"):
            setattr(self, name, resolve_demo(getattr(self, name)))

    def _validate_speculative(self) -> None:
        """The flags every algorithm shares; then the algorithm's own rules (``Proposer.check_args``)."""
        if self.speculative_algorithm is None:
            return
        from specserve.speculative.registry import check_speculative_args

        if self.speculative_batch_token_budget < 0:
            raise ConfigError(f"--speculative-batch-token-budget must be >= 0 (0 = no shrinking), got "
                              f"{self.speculative_batch_token_budget}")
        require_positive(self, "speculative_disable_batch_size", allow_none=True)
        for name in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{flag_name(name)} must be in (0, 1] (1.0 = lossless), got {value}")
        if not 0.0 <= self.speculative_draft_stop_threshold < 1.0:
            raise ConfigError(f"--speculative-draft-stop-threshold must be in [0, 1) (0 = off), got "
                              f"{self.speculative_draft_stop_threshold}")
        if not 0.0 < self.speculative_draft_score_temperature <= MAX_SCORE_TEMPERATURE:
            raise ConfigError(f"--speculative-draft-score-temperature must be in (0, {MAX_SCORE_TEMPERATURE:g}] "
                              f"(1 = the draft's own probabilities), got {self.speculative_draft_score_temperature}")
        check_speculative_args(self)

    def resolve_speculative_defaults(self, architecture: str) -> None:
        """Fill the draft tree flags when none was given, as the algorithm chooses for this target architecture
        (``Proposer.default_tree``)."""
        from specserve.speculative.registry import resolve_tree_defaults

        resolve_tree_defaults(self, architecture)

    # ------------------------------------------------------------------
    @property
    def effective_max_running_requests(self) -> int:
        if self.max_running_requests is not None:
            return self.max_running_requests
        return 48 if self.speculative_algorithm else 256

    @property
    def effective_cuda_graph_max_bs(self) -> int:
        """Graphs are captured lazily (specserve.models.cuda_graph), so the bound costs no start-up time; a verify
        forward is N tokens per request, so it is lower with speculation."""
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        return 32 if self.speculative_algorithm else 128

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
