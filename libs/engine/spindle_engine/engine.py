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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its blocks. Returns False if it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

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
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator)
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self.requests[seq.request_id]
            outputs.append(StepOutput(seq.request_id, [token], reason is not None, reason))
        return outputs
