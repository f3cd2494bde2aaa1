"""One engine instance: requests in, tokens out, step by step.

`Engine` is the building block the services drive (add_request / step / abort); `LLM` in llm.py wraps it
for offline batch generation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from spindle_model import LlamaModel, ModelConfig, load_state_dict, resolve_model

from .config import EngineConfig
from .kv_cache import BlockAllocator, KVCache
from .model_runner import ModelRunner
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Sequence

log = logging.getLogger("spindle.engine")


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    kv_ready: bool = False  # a prefill-only request computed its prompt: export_kv, then release


class Engine:
    def __init__(self, config: EngineConfig, *, model: LlamaModel | None = None) -> None:
        self.config = config
        t0 = time.perf_counter()
        if model is None:
            self.source = resolve_model(config.model)
            model_config = self.source.config
            model = LlamaModel(model_config, dtype=config.torch_dtype)
            model.load_weights(load_state_dict(self.source.path, dtype=config.torch_dtype))
        else:
            self.source = None
            model_config = model.config
            if model.dtype != config.torch_dtype:
                raise ValueError(f"the model is {model.dtype} but the engine is configured for {config.dtype}")
        if config.max_model_len is not None and config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context of "
                f"{model_config.max_position_embeddings} tokens"
            )
        self.model = model.eval()
        self.model_config: ModelConfig = model_config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.eos_token_ids: set[int] = set(model_config.eos_token_ids)
        per_token = KVCache.bytes_per_token(
            len(model.layers), model.num_local_kv_heads, model_config.head_dim, config.torch_dtype
        )
        tokens = config.kv_cache_tokens or int(config.kv_cache_memory_gb * 2**30 // per_token)
        num_blocks = tokens // config.block_size
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"KV cache of {num_blocks * config.block_size} tokens cannot hold one {self.max_model_len}-token "
                "sequence; raise kv_cache_tokens / kv_cache_memory_gb or lower max_model_len"
            )
        self.cache = KVCache(
            len(model.layers),
            num_blocks,
            config.block_size,
            model.num_local_kv_heads,
            model_config.head_dim,
            config.torch_dtype,
        )
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, config.long_prefill_token_threshold),
            self.allocator,
        )
        self.runner = ModelRunner(self.model, self.cache)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefilled, KV kept for a hand-off
        self.reserved: dict[str, list[int]] = {}  # block tables reserved for incoming KV
        log.info(
            "engine ready in %.2fs: %d KV blocks x %d tokens (%.2f GiB)",
            time.perf_counter() - t0,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size * per_token / 2**30,
        )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        n = len(prompt_token_ids)
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.held or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        """Queue a request. With `prefill_only`, it stops after its first token and keeps its KV (`kv_ready`)."""
        self._check_new_id(request_id)
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), params, prefill_only=prefill_only)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    # ---- KV hand-off: the prefill side ----

    def export_kv(self, request_id: str) -> torch.Tensor:
        """KV of a prefilled request's prompt -> `[2, layers, prompt_tokens, kv_heads, head_dim]`."""
        seq = self.held[request_id]
        return self.cache.gather(seq.block_table, seq.num_prompt_tokens)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a prefilled request whose KV has been handed off (or given up)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.allocator.free(request_id, seq.block_table)
        return True

    # ---- KV hand-off: the decode side ----

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the KV tensor that `import_kv` takes for `num_tokens` tokens."""
        return (2, len(self.model.layers), num_tokens, self.model.num_local_kv_heads, self.model_config.head_dim)

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Reserve blocks for `num_tokens` incoming tokens of KV; False when they are not free now."""
        self._check_new_id(request_id)
        if not 0 < num_tokens < self.max_model_len:
            raise ValueError(f"cannot reserve {num_tokens} tokens (context is {self.max_model_len})")
        table: list[int] = []
        if not self.allocator.can_allocate(num_tokens + 1, table):  # +1: the first decode step's token
            return False
        self.allocator.allocate(request_id, num_tokens, table)
        self.reserved[request_id] = table
        return True

    def cancel_reservation(self, request_id: str) -> bool:
        table = self.reserved.pop(request_id, None)
        if table is None:
            return False
        self.allocator.free(request_id, table)
        return True

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token: int, kv: torch.Tensor, params: SamplingParams
    ) -> None:
        """Start decoding a request whose prompt KV was computed elsewhere, into blocks from `reserve`."""
        table = self.reserved.get(request_id)
        if table is None:
            raise ValueError(f"request {request_id!r} has no reservation")
        n = len(prompt_token_ids)
        if tuple(kv.shape) != self.kv_shape(n):
            raise ValueError(f"KV shape {tuple(kv.shape)} does not match {self.kv_shape(n)} for {n} prompt tokens")
        self.validate_prompt(prompt_token_ids)
        del self.reserved[request_id]
        self.cache.scatter(table, kv)
        seq = Sequence(request_id, [*prompt_token_ids, first_token], params, num_prompt_tokens=n)
        seq.num_computed_tokens = n
        seq.block_table = table
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks (queued, running, held or reserved). False if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            return True
        return self.release(request_id) or self.cancel_reservation(request_id)

    def blocks_held(self) -> dict[str, int]:
        """Blocks per request id, from the allocator (so KV held for SP prefill counts too), plus 0 for
        requests that hold none yet."""
        out = dict.fromkeys(self.requests, 0)
        out.update(self.allocator.blocks_by_owner())
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return self.allocator.num_used / self.allocator.num_blocks

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[StepOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits, rows = self.runner.run(chunks)
        for c in chunks:
            c.seq.num_computed_tokens += c.num_tokens
        seqs = [chunks[i].seq for i in rows]
        tokens = sample(logits, [s.params for s in seqs], [s.step_generator() for s in seqs], self.generator)
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self.requests[seq.request_id]
            elif seq.prefill_only:
                self.scheduler.detach(seq)
                del self.requests[seq.request_id]
                self.held[seq.request_id] = seq
                outputs.append(StepOutput(seq.request_id, [token], False, None, kv_ready=True))
                continue
            outputs.append(StepOutput(seq.request_id, [token], reason is not None, reason))
        return outputs
