"""One engine instance: requests in, tokens out, step by step.

`Engine` is the building block the services drive (add_request / step / abort); `LLM` in llm.py wraps it
for offline batch generation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from spindle_model import LlamaModel, ModelConfig, attach_gguf_blocks, load_state_dict, resolve_model

from .config import EngineConfig
from .cpu_decode import CPUDecodeRunner, unsupported_reason
from .cuda_graphs import DecodeGraphRunner, graph_mode
from .flash_attention import unsupported_reason as flash_unsupported
from .grammar import GrammarCompiler
from .kv_cache import BlockAllocator, KVCache
from .model_runner import ModelRunner
from .sampler import TokenLogprobs, sample
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from .sequence import CHOICE_SEP, Sequence, SequenceStatus, choice_id, split_choice, stop_reason

log = logging.getLogger("spindle.engine")


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    kv_ready: bool = False  # a prefill-only request computed its prompt: export_kv, then release
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    choice: int = 0  # which of an n > 1 request's choices (each finishes on its own)
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first output: prompt positions 1.. (asked for)


@dataclass(frozen=True)
class PreemptedSequence:
    """A decoding request taken out of the batch: what `resume` needs to continue it exactly."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    kv: torch.Tensor  # [2, layers, num_tokens - 1, kv_heads, head_dim]: the last output has no KV yet
    params: SamplingParams

    @property
    def num_kv_tokens(self) -> int:
        return len(self.token_ids) - 1


class Engine:
    def __init__(self, config: EngineConfig, *, model: LlamaModel | None = None) -> None:
        self.config = config
        t0 = time.perf_counter()
        device = config.torch_device
        self.device = device
        if model is None:
            self.source = resolve_model(config.model)
            model_config = self.source.config
            model = LlamaModel(model_config, dtype=config.torch_dtype, device=device)
            model.load_weights(load_state_dict(self.source.path, dtype=config.torch_dtype))
            if config.gguf_blocks and self.source.gguf is not None:
                attach_gguf_blocks(model, self.source.gguf)
        else:
            self.source = None
            model_config = model.config
            if model.dtype != config.torch_dtype:
                raise ValueError(f"the model is {model.dtype} but the engine is configured for {config.dtype}")
            if model.device != device:
                raise ValueError(f"the model is on {model.device} but the engine is configured for {device}")
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
        num_blocks = config.kv_tokens(per_token) // config.block_size
        if num_blocks * config.block_size < self.max_model_len and not config.allow_partial_kv:
            raise ValueError(
                f"KV cache of {num_blocks * config.block_size} tokens cannot hold one {self.max_model_len}-token "
                "sequence; raise kv_cache_tokens / kv_cache_memory_gb or lower max_model_len"
            )
        self.attention_backend = config.resolved_attention_backend
        if self.attention_backend == "flash-attn":
            reason = flash_unsupported(model_config.head_dim, config.torch_dtype, config.block_size)
            if reason is not None:
                raise ValueError(f"attention_backend 'flash-attn' cannot run this model: {reason}")
        graphs = graph_mode(config.cuda_graphs, device, self.attention_backend, model)
        self.cache = KVCache(
            len(model.layers),
            num_blocks + (graphs is not None),  # the last block is the graphs' scratch, never allocated
            config.block_size,
            model.num_local_kv_heads,
            model_config.head_dim,
            config.torch_dtype,
            device,
        )
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                config.long_prefill_token_threshold,
                config.shared_prefill_chunk,
            ),
            self.allocator,
        )
        decode_graphs = None
        if graphs is not None:
            decode_graphs = DecodeGraphRunner(
                self.model,
                self.cache,
                max_batch=min(config.max_num_seqs, config.cuda_graph_max_batch),
                max_model_len=self.max_model_len,
                scratch_block=num_blocks,
                attention_backend=self.attention_backend,
                mode=graphs,
            )
            if config.cuda_graphs_at_start and graphs == "cuda":
                decode_graphs.capture_all()
        cpu_decode = None
        fused = config.fused_cpu_decode and self.attention_backend == "torch"
        if fused and unsupported_reason(model, self.cache) is None:
            cpu_decode = CPUDecodeRunner(self.model, self.cache)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            attention_backend=self.attention_backend,
            decode_graphs=decode_graphs,
            cpu_decode=cpu_decode,
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        # compiles requests' grammars from the model directory's tokenizer.json (an engine given its model, such as
        # a TP follower's shard, finds the directory by the configured name)
        self.grammars = GrammarCompiler.for_model(
            self.source.path if self.source is not None else config.model,
            model_config.vocab_size,
            model_config.eos_token_ids,
        )
        self.requests: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefilled, KV kept for a hand-off
        self.directed: dict[str, Sequence] = {}  # stepped only when the caller names them (step_directed)
        self.reserved: dict[str, list[int]] = {}  # block tables reserved for incoming KV
        log.info(
            "engine ready in %.2fs on %s (%s attention, decode graphs: %s): %d KV blocks x %d tokens (%.2f GiB)",
            time.perf_counter() - t0,
            device,
            self.attention_backend,
            graphs or "off",
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
        if request_id in self.directed:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        """Queue a request. With `prefill_only`, it stops after its first token and keeps its KV (`kv_ready`).

        A request of `n > 1` choices is prefilled here (`prefill_only`) and decoded by an engine that resumes it
        (`resume` forks the choices from the one prompt KV); this engine alone does not fork it."""
        if params.n > 1 and not prefill_only:
            raise ValueError("n > 1 needs a decode engine (Engine.resume); add one request per choice instead")
        self._check_new_id(request_id)
        self.validate_prompt(prompt_token_ids)
        capacity = self.allocator.num_blocks * self.config.block_size
        if min(len(prompt_token_ids) + params.max_tokens, self.max_model_len) > capacity:  # allow_partial_kv only
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds this engine's "
                f"KV cache of {capacity} tokens (an elastic group holds longer requests in parts)"
            )
        seq = Sequence(request_id, list(prompt_token_ids), params, prefill_only=prefill_only)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    # ---- directed steps: the caller (a per-iteration scheduler) names what each step computes ----

    def add_directed(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Hold a request that only `step_directed` runs (the engine's own scheduler never does): an elastic
        instance whose iterations the cluster scheduler plans (LoongServe). Takes no blocks yet."""
        if params.n > 1:
            raise ValueError("directed requests decode one choice (n = 1)")
        self._check_new_id(request_id)
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        seq.status = SequenceStatus.RUNNING
        self.directed[request_id] = seq

    def directed_room(self, prefill: dict[str, int], decode: list[str]) -> int:
        """Blocks `step_directed(prefill, decode)` would take beyond what its requests hold."""
        need = 0
        for rid, n in [*prefill.items(), *((r, 1) for r in decode)]:
            seq = self.directed[rid]
            need += -(-(seq.num_computed_tokens + n) // self.config.block_size) - len(seq.block_table)
        return need

    def step_directed(self, prefill: dict[str, int], decode: list[str]) -> list[StepOutput]:
        """One step on exactly these directed requests: `prefill` maps a request to the prompt tokens it computes
        now (its next ones), `decode` gives each of its requests one token. A request that ends (stop, length)
        frees its blocks. ValueError, and nothing run, when one is unknown, out of order, or the blocks do not
        fit."""
        for rid, n in prefill.items():
            seq = self.directed.get(rid)
            if seq is None or not 0 < n <= seq.num_prompt_tokens - seq.num_computed_tokens:
                raise ValueError(f"no {n} prompt tokens of {rid!r} left to prefill")
        for rid in decode:
            seq = self.directed.get(rid)
            prefilled = seq is not None and seq.num_computed_tokens >= seq.num_prompt_tokens
            if seq is None or not prefilled or seq.num_uncomputed != 1 or rid in prefill:
                raise ValueError(f"{rid!r} is not a decoding directed request")
        if parted := [r for r in [*prefill, *decode] if self.directed[r].kv_positions is not None]:
            raise ValueError(f"{parted} are held in parts by an elastic group: spindle_engine.esp steps them")
        if self.directed_room(prefill, decode) > self.allocator.num_free:
            raise ValueError(f"no KV room for the step: {self.directed_room(prefill, decode)} blocks needed, "
                             f"{self.allocator.num_free} free")  # fmt: skip
        chunks = []
        for rid, n in [*prefill.items(), *((r, 1) for r in decode)]:
            seq = self.directed[rid]
            self.allocator.allocate(rid, seq.num_computed_tokens + n, seq.block_table)
            chunks.append(ScheduledChunk(seq, n))
        if not chunks:
            return []
        return self._run(chunks)

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

    def decode_held(self, request_id: str) -> bool:
        """Decode a prefilled (`prefill_only`) request of n > 1 choices in this engine (a colocated instance): its
        prompt KV moves into one reservation per choice and `resume` forks them. False (and the request is gone)
        when the choices' blocks are not free now."""
        seq = self.held[request_id]
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        kv = self.export_kv(request_id)  # [2, layers, prompt_tokens, kv_heads, head_dim]
        self.release(request_id)
        if not self.reserve(request_id, len(prompt), seq.params.n):
            return False
        self.resume(request_id, [*prompt, seq.token_ids[-1]], len(prompt), kv, seq.params)
        return True

    # ---- KV hand-off: the decode side ----

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the KV tensor that `import_kv` takes for `num_tokens` tokens."""
        return (2, len(self.model.layers), num_tokens, self.model.num_local_kv_heads, self.model_config.head_dim)

    def reserve(self, request_id: str, num_tokens: int, choices: int = 1) -> bool:
        """Reserve blocks for `num_tokens` incoming tokens of KV, once per choice (every choice of an n > 1
        request gets its own copy of the prompt's KV); False when they are not free now."""
        ids = [choice_id(request_id, i) for i in range(choices)]
        for sid in ids:
            self._check_new_id(sid)
        if not 0 < num_tokens < self.max_model_len:
            raise ValueError(f"cannot reserve {num_tokens} tokens (context is {self.max_model_len})")
        per_choice = self.allocator.blocks_needed(num_tokens + 1, [])  # +1: the first decode step's token
        if per_choice * choices > self.allocator.num_free:
            return False
        for sid in ids:
            table: list[int] = []
            self.allocator.allocate(sid, num_tokens, table)
            self.reserved[sid] = table
        return True

    def cancel_reservation(self, request_id: str) -> bool:
        done = False
        for sid in self._sequence_ids(request_id, self.reserved):
            self.allocator.free(sid, self.reserved.pop(sid))
            done = True
        return done

    @staticmethod
    def _sequence_ids(request_id: str, where: dict) -> list[str]:
        """The ids in `where` of a request's choices: the request's own, then "request#i" for choice i."""
        prefix = request_id + CHOICE_SEP
        return [sid for sid in where if sid == request_id or (sid.startswith(prefix) and sid[len(prefix) :].isdigit())]

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token: int, kv: torch.Tensor, params: SamplingParams
    ) -> None:
        """Start decoding a request whose prompt KV was computed elsewhere, into blocks from `reserve`."""
        self.resume(request_id, [*prompt_token_ids, first_token], len(prompt_token_ids), kv, params)

    def resume(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        kv: torch.Tensor,
        params: SamplingParams,
    ) -> None:
        """Continue decoding a request whose KV for all but the last of `token_ids` (prompt, then outputs so
        far) was computed elsewhere or earlier, into blocks from `reserve(request_id, len(token_ids) - 1)`."""
        table = self.reserved.get(request_id)
        if table is None:
            raise ValueError(f"request {request_id!r} has no reservation")
        n = len(token_ids) - 1
        if not 0 < num_prompt_tokens <= n:
            raise ValueError(f"{num_prompt_tokens} prompt tokens do not fit {len(token_ids)} tokens with an output")
        if tuple(kv.shape) != self.kv_shape(n):
            raise ValueError(f"KV shape {tuple(kv.shape)} does not match {self.kv_shape(n)} for {n} tokens")
        if len(table) * self.config.block_size < n:
            raise ValueError(f"the reservation of {request_id!r} is too small for {n} tokens")
        self.validate_prompt(token_ids[:num_prompt_tokens])
        self.validate_prompt(token_ids)  # the outputs are token ids in the vocabulary too
        if params.n > 1:
            self._fork(request_id, token_ids[:num_prompt_tokens], kv, params)
            return
        del self.reserved[request_id]
        self.cache.scatter(table, kv)
        seq = Sequence(request_id, list(token_ids), params, num_prompt_tokens=num_prompt_tokens)
        seq.num_computed_tokens = n
        seq.block_table = table
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _fork(self, request_id: str, prompt: list[int], kv: torch.Tensor, params: SamplingParams) -> None:
        """Every choice of an n > 1 request decodes from the one prompt KV: each gets a copy of it in its own
        reserved blocks and recomputes the prompt's last token for its own first output (one token of work per
        choice; the first token the prefill sampled is not used)."""
        if kv.shape[2] != len(prompt):
            raise ValueError(f"a request with n = {params.n} resumes from its prompt's KV, not mid-decode")
        ids = [choice_id(request_id, i) for i in range(params.n)]
        missing = [sid for sid in ids if sid not in self.reserved]
        if missing:
            raise ValueError(f"request {request_id!r} has no reservation for choices {missing}")
        for i, sid in enumerate(ids):
            table = self.reserved.pop(sid)
            self.cache.scatter(table, kv[:, :, : len(prompt) - 1])
            seq = Sequence(sid, list(prompt), params.for_choice(i))
            seq.num_computed_tokens = len(prompt) - 1
            seq.block_table = table
            self.requests[sid] = seq
            self.scheduler.add(seq)

    # ---- preemption to outside the engine (the kvstore) ----

    def preempt_out(self, request_id: str, *, keep_blocks: bool = False) -> PreemptedSequence:
        """Take a decoding request out of the batch between steps, with the KV of its computed tokens.

        Its blocks are freed, or with `keep_blocks` kept (as for a hand-off) until `release`, or until
        `readmit` puts it back into the batch. ValueError unless it is decoding: queued or still prefilling,
        recomputing after an in-engine preemption, prefill-only, finished or unknown.
        """
        seq = self.requests.get(request_id)
        if seq is None or seq.prefill_only:
            raise ValueError(f"request {request_id!r} is not decoding here")
        if len(self._sequence_ids(request_id, self.requests)) > 1:
            raise ValueError(f"request {request_id!r} decodes several choices (n > 1); it is not preempted")
        if seq.num_tokens <= seq.num_prompt_tokens or seq.num_computed_tokens != seq.num_tokens - 1:
            raise ValueError(f"request {request_id!r} is not decoding (its KV is not complete)")
        kv = self.cache.gather(seq.block_table, seq.num_computed_tokens)
        out = PreemptedSequence(request_id, list(seq.token_ids), seq.num_prompt_tokens, kv, seq.params)
        del self.requests[request_id]
        if keep_blocks:
            self.scheduler.detach(seq, "preempted")
            self.held[request_id] = seq
        else:
            self.scheduler.finish(seq, "preempted")
        return out

    def readmit(self, request_id: str) -> None:
        """Put a request taken out with `preempt_out(keep_blocks=True)` back into the batch."""
        seq = self.held.get(request_id)
        if seq is None or seq.finish_reason != "preempted":
            raise ValueError(f"request {request_id!r} was not preempted with its blocks kept")
        del self.held[request_id]
        seq.status = SequenceStatus.WAITING
        seq.finish_reason = None
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks (queued, running, held or reserved; every choice). False if
        unknown."""
        found = False
        if (seq := self.directed.pop(request_id, None)) is not None:
            self.allocator.free(request_id, seq.block_table)
            seq.status, seq.finish_reason, found = SequenceStatus.FINISHED, "abort", True
        for sid in self._sequence_ids(request_id, self.requests):
            self.scheduler.finish(self.requests.pop(sid), "abort")
            found = True
        released = self.release(request_id)
        cancelled = self.cancel_reservation(request_id)
        return found or released or cancelled

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
        return stop_reason(seq, token, self.eos_token_ids, self.max_model_len)

    def step(self) -> list[StepOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        return self._run(chunks)

    def _run(self, chunks: list[ScheduledChunk]) -> list[StepOutput]:
        """Compute the chunks, sample where a chunk completes its sequence's tokens, and end what stops."""
        logits, rows = self.runner.run(chunks)
        for c in chunks:
            c.seq.num_computed_tokens += c.num_tokens
        seqs = [chunks[i].seq for i in rows]
        sampled = sample(logits, seqs, self.generator, self.eos_token_ids, self.grammars)
        outputs = []
        for seq, token, lp in zip(seqs, sampled.tokens, sampled.logprobs, strict=True):
            lps = None if lp is None else [lp]
            seq.token_ids.append(token)
            prompt_lps = None
            if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
                prompt_lps = seq.prompt_logprobs
            reason = self._stop_reason(seq, token)
            if seq.prefill_only and seq.params.n > 1:
                reason = None  # its choices are sampled where it decodes: never ends at this token
            if reason is not None and seq.request_id in self.directed:
                self.allocator.free(seq.request_id, seq.block_table)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                del self.directed[seq.request_id]
            elif reason is not None:
                self.scheduler.finish(seq, reason)
                del self.requests[seq.request_id]
            elif seq.prefill_only:
                self.scheduler.detach(seq)
                del self.requests[seq.request_id]
                self.held[seq.request_id] = seq
                outputs.append(
                    StepOutput(
                        seq.request_id, [token], False, None, kv_ready=True, logprobs=lps, prompt_logprobs=prompt_lps
                    )
                )
                continue
            rid, choice = split_choice(seq.request_id)
            done = reason is not None
            out = StepOutput(rid, [token], done, reason, logprobs=lps, choice=choice, prompt_logprobs=prompt_lps)
            outputs.append(out)
        return outputs
