"""Engine configuration: validated at construction, including which attention backend runs (resolved through
`spindle_attention.backends`' registry, so a backend that cannot run here fails now, not mid-step)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from spindle_attention.backends import AUTO, select_backend
from spindle_attention.backends.flash import DTYPES as FLASH_DTYPES

log = logging.getLogger("spindle.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "torch" names the engine's original path: Spindle's native CPU kernels where they are built, else the reference;
# the other names are the registry's backends (spindle_attention.backends)
ATTENTION_BACKENDS = ("auto", "torch", "reference", "cpu", "triton", "flash-attn")
_dtype_skips_logged: set[torch.dtype] = set()  # dtypes for which `auto` logged skipping flash-attn


def resolve_attention(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """The engine's attention context for `requested` on `device` (see `attention.CONTEXTS`): "torch" for `torch`,
    `cpu` and what `auto` resolves to on CPU, "reference", "triton" or "flash-attn". ValueError (the registry's,
    saying why) when the backend asked for cannot run here."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "torch":  # the engine's own path (native kernels where built, else the reference): runs anywhere
        return "torch"
    if requested == "flash-attn" and dtype not in FLASH_DTYPES:
        raise ValueError(f"attention_backend='flash-attn' runs float16 or bfloat16, not {dtype}")
    chosen = select_backend(device, requested, block_size=block_size)
    if requested == AUTO and chosen.name == "flash-attn" and dtype not in FLASH_DTYPES:
        assert chosen.fallback is not None  # the reference at least
        if dtype not in _dtype_skips_logged:
            _dtype_skips_logged.add(dtype)
            why = "it runs float16 and bfloat16"
            log.info("attention backend 'flash-attn' skipped for %s (%s); using %r", dtype, why, chosen.fallback.name)
        chosen = chosen.fallback
    if requested == "reference" or chosen.name in ("triton", "flash-attn"):
        return chosen.name
    return "torch"  # `cpu`, and `auto`'s cpu or reference: the engine's original path


def check_device(device: str) -> torch.device:
    """Parse "cpu" / "cuda" / "cuda:N"; ValueError when it is malformed or CUDA is asked for but missing."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available (torch {torch.__version__})")
    count = torch.cuda.device_count()
    index = 0 if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device {device!r} asked for, but there are {count} CUDA devices")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"  # a known name, an HF Llama directory, or a .gguf file
    dtype: str = "float32"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": weights, KV cache and step inputs live there
    # one of ATTENTION_BACKENDS. "auto": on CUDA flash-attn (installed, sm80+, float16/bfloat16, block_size a
    # multiple of 256), else triton, else the reference; on CPU the engine's "torch" path
    attention_backend: str = "auto"
    block_size: int = 16
    kv_cache_tokens: int | None = None  # KV capacity in tokens; default from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    shared_prefill_chunk: int = 0  # > 0: a sequence's chunk while others share the engine (scheduler.py)
    max_model_len: int | None = None  # default: the model's context length
    # a member of an elastic group (spindle_engine.esp) holds parts of sequences longer than its own KV cache:
    # max_model_len is then the group's context, and only the engine's own scheduling needs a sequence to fit here
    allow_partial_kv: bool = False
    seed: int = 0  # for requests that carry no seed of their own
    # decode-only steps replay a CUDA graph per batch bucket (CUDA with the triton backend only; see cuda_graphs.py)
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256  # largest bucket: min(max_num_seqs, this); larger decode steps run eagerly
    # capture every bucket's graph when the engine starts (start takes seconds longer; no step ever waits for a
    # capture), else each on its first use; the decode service captures at start
    cuda_graphs_at_start: bool = False
    # CPU, float32, torch attention backend: decode-only steps of up to 32 sequences run the layer stack in one
    # native call (cpu_decode.py)
    fused_cpu_decode: bool = True
    # CPU, float32, model from a GGUF file: small-batch matmuls read the file's Q4_1/Q8_0 blocks, which give the
    # same float32 weights bit for bit (gguf_blocks.py); prefill keeps the float32 weights
    gguf_blocks: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {self.device!r}")
        dev = check_device(self.device)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        context = resolve_attention(self.attention_backend, dev, DTYPES[self.dtype], self.block_size)
        object.__setattr__(self, "_attention_context", context)  # not a field: replace() and asdict() ignore it
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return check_device(self.device)

    @property
    def resolved_attention_backend(self) -> str:
        """The engine's attention context in force: "torch", "reference", "triton" or "flash-attn" (see
        `resolve_attention`)."""
        return self._attention_context

    def kv_tokens(self, bytes_per_token: int) -> int:
        """KV capacity in tokens: `kv_cache_tokens`, or what fits into `kv_cache_memory_gb`."""
        return self.kv_cache_tokens or int(self.kv_cache_memory_gb * 2**30 // bytes_per_token)
