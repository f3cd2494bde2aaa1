"""The cost model: seconds for one iteration of a batch (prefill chunks + decodes) on a parallel group.

Per layer and GPU, every op is a roofline term, `max(compute at a fitted efficiency, memory at a fitted
efficiency) + kernels x a fixed kernel cost`:
- GEMMs (QKV, O, MLP up and down) on the rank's tokens and its 1/TP of the weights; the LM head once per
  iteration, for one row per prefill chunk and per decode;
- prefill attention over the chunk's causal half plus its C*L history pairs (Tetris Eq. 1's L^2 and C*L terms),
  divided over the SP group, times CSA's kept fraction; decode attention as the read of each context's KV
  (its 1/KVP range);
- norms, RoPE, SiLU*up and residuals as activation bytes.
Communication, not overlapped unless said: TP all-reduces (two per layer), the SP ring (per step the KV block
it passes against the attention it overlaps, the max of the two, plus the implementation's per-step sync),
Ulysses all-to-alls, KVP's query broadcast and partial-output gather, PP activation sends. Pipelines (PP):
one iteration's latency is the sum of its stages; `stage_s` is one stage's share, what bounds throughput; a
chunked prefill on PP stages is a sequence pipeline (Medha's SPP), chunks overlapping across stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .breakdown import Breakdown, OpCost
from .hardware import Hardware
from .memory import MemoryPlan, memory_plan
from .model import ModelShape
from .parallel import Parallelism, allgather_s, allreduce_s, alltoall_s, hierarchical_allgather_s

SINGLE = Parallelism()  # one GPU
LAYER_OPS = ("qkv_proj", "attention_prefill", "attention_decode", "o_proj", "mlp_up", "mlp_down", "elementwise")


@dataclass(frozen=True)
class Chunk:
    """`tokens` new prompt tokens after `history` cached ones."""

    tokens: int
    history: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.history < 0:
            raise ValueError(f"a chunk needs tokens >= 1 and history >= 0, got {self.tokens}, {self.history}")


class CostModel:
    """Cost queries for one (model, hardware). Pure; repeated queries are cached."""

    def __init__(self, model: ModelShape, hardware: Hardware, mem_utilization: float = 0.9) -> None:
        if not 0 < mem_utilization <= 1:
            raise ValueError(f"mem_utilization must be in (0, 1], got {mem_utilization}")
        self.model, self.hw, self.mem_utilization = model, hardware, mem_utilization
        self.iteration = lru_cache(maxsize=65536)(self._iteration)  # type: ignore[method-assign]
        self._chunked = lru_cache(maxsize=4096)(self._chunked_prefill)  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"CostModel({self.model.name} on {self.hw.name})"

    # ---- shards -------------------------------------------------------------------------------------
    def _heads(self, par: Parallelism) -> tuple[int, int]:
        m = self.model
        if m.heads % par.tp:
            raise ValueError(f"{m.name}: {m.heads} heads do not split over TP {par.tp}")
        if m.layers < par.pp:
            raise ValueError(f"{m.name}: {m.layers} layers do not fill {par.pp} pipeline stages")
        return m.heads // par.tp, math.ceil(m.kv_heads / par.tp)  # KV heads replicate when TP exceeds them

    def _roofline(
        self, name: str, flops: float, nbytes: float, attention: bool = False, kernels: int = 1, kv: bool = False
    ) -> OpCost:
        eff = self.hw.eff
        compute = flops / (self.hw.peak_flops * (eff.attention if attention else eff.gemm))
        bandwidth = eff.kv_memory if kv and eff.kv_memory is not None else eff.memory
        memory = nbytes / (self.hw.mem_bandwidth * bandwidth)
        exposed = max(compute, memory) + (1 - eff.overlap) * min(compute, memory)
        return OpCost(name, compute, memory, 0.0, exposed + kernels * eff.kernel_s)

    def _gemm(self, name: str, tokens: float, k: int, n: int) -> OpCost:
        b = self.model.dtype_bytes
        return self._roofline(name, 2.0 * tokens * k * n, b * (k * n + tokens * (k + n)))

    # ---- one iteration ----------------------------------------------------------------------------------
    def _iteration(
        self, chunks: tuple[Chunk, ...], num_decodes: int, decode_kv_tokens: int, par: Parallelism, keep: float
    ) -> Breakdown:
        m, hw, b = self.model, self.hw, self.model.dtype_bytes
        if not chunks and num_decodes == 0:
            raise ValueError("an iteration needs at least one prefill chunk or decode")
        if num_decodes < 0 or decode_kv_tokens < 0 or not 0 < keep <= 1:
            raise ValueError("decodes and KV tokens must be >= 0 and keep in (0, 1]")
        q_heads, kv_heads = self._heads(par)
        hd, sp = m.head_dim, par.sp
        prefill_tokens = sum(math.ceil(c.tokens / sp) for c in chunks)  # this rank's share
        tokens = prefill_tokens + num_decodes
        inter = math.ceil(m.intermediate / par.tp)

        layer: list[OpCost] = [
            self._gemm("qkv_proj", tokens, m.hidden, (q_heads + 2 * kv_heads) * hd),
            self._gemm("o_proj", tokens, q_heads * hd, m.hidden),
            self._gemm("mlp_up", tokens, m.hidden, 2 * inter),
            self._gemm("mlp_down", tokens, inter, m.hidden),
        ]
        act_bytes = b * tokens * (10 * m.hidden + 3 * inter + 2 * (q_heads + kv_heads) * hd)
        layer.append(self._roofline("elementwise", 0.0, act_bytes, kernels=5))

        ring_exposed = ring_comm = 0.0
        if chunks:
            pairs = [(c.history * c.tokens + c.tokens * c.tokens / 2) * keep / sp for c in chunks]
            # head-split SP (Ulysses, SP-TP): the slowest rank computes ceil(heads / sp) heads over every token
            uneven = math.ceil(q_heads / sp) * sp / q_heads if sp > 1 and par.sp_kind != "ring" else 1.0
            flops = 4.0 * sum(pairs) * q_heads * hd * uneven
            kv_read = sum(c.history + c.tokens for c in chunks) / sp * 2 * kv_heads * hd * b
            attn = self._roofline("attention_prefill", flops, kv_read + 2 * prefill_tokens * q_heads * hd * b, True)
            layer.append(attn)
            if sp > 1 and par.sp_kind == "ring":
                link = hw.link(par.spans_nodes("sp", hw.gpus_per_node))
                for c, p in zip(chunks, pairs, strict=True):
                    block = (c.history + c.tokens) / sp * 2 * kv_heads * hd * b
                    step_comm = link.transfer_s(block)
                    step_compute = 4.0 * p * q_heads * hd / (hw.peak_flops * hw.eff.attention) / sp
                    ring_comm += (sp - 1) * step_comm
                    ring_exposed += (sp - 1) * (max(0.0, step_comm - step_compute) + hw.eff.ring_step_s)
                layer.append(OpCost("sp_ring", comm_s=ring_comm, s=ring_exposed))
            elif sp > 1 and par.sp_kind == "sp-tp":
                # CSPS SP-TP: all-gather the chunk's hidden states, tensor-parallel attention over the whole
                # sequence (heads split sp ways: the same pairs per rank), reduce-scatter the output
                hidden = sum(c.tokens for c in chunks) * m.hidden * b
                per_node = max(1, hw.gpus_per_node // par.tp)  # SP groups stride by the TP size
                if par.cross_nodes:  # placed over at least two nodes
                    per_node = min(per_node, -(-sp // 2))
                t = 2 * hierarchical_allgather_s(hidden, sp, per_node, hw.intra, hw.inter)
                layer.append(OpCost("sp_allgather", comm_s=t, s=t))
            elif sp > 1:
                link = hw.link(par.spans_nodes("sp", hw.gpus_per_node))
                moved = prefill_tokens * (2 * q_heads + 2 * max(kv_heads, sp)) * hd * b
                t = alltoall_s(moved, sp, link) + alltoall_s(0, sp, link)  # q,k,v in; output back
                layer.append(OpCost("sp_alltoall", comm_s=t, s=t))
        if num_decodes:
            kv = decode_kv_tokens / par.kvp * 2 * kv_heads * hd * b
            flops = 4.0 * decode_kv_tokens / par.kvp * q_heads * hd
            kv_bytes = kv + 2 * num_decodes * q_heads * hd * b
            layer.append(self._roofline("attention_decode", flops, kv_bytes, attention=True, kv=True))
            if par.kvp > 1:
                link = hw.link(par.spans_nodes("kvp", hw.gpus_per_node))
                t = allgather_s(num_decodes * q_heads * (hd + 1) * 4, par.kvp, link) + link.transfer_s(
                    num_decodes * q_heads * hd * b
                )
                layer.append(OpCost("kvp_exchange", comm_s=t, s=t))
        if par.tp > 1:
            link = hw.link(par.spans_nodes("tp", hw.gpus_per_node))
            t = 2 * allreduce_s(tokens * m.hidden * b, par.tp, link)
            layer.append(OpCost("tp_allreduce", comm_s=t, s=t))

        layers = m.layers
        ops = {o.name: o.scaled(layers) for o in layer}
        rows = len(chunks) + num_decodes
        vocab = math.ceil(m.vocab / par.tp)
        ops["lm_head"] = self._gemm("lm_head", rows, m.hidden, vocab)
        total = sum(o.s for o in ops.values())
        stage = (total - ops["lm_head"].s) / par.pp + ops["lm_head"].s
        if par.pp > 1:
            link = hw.link(par.spans_nodes("pp", hw.gpus_per_node))
            send = link.transfer_s(tokens * m.hidden * b)
            ops["pp_send"] = OpCost("pp_send", comm_s=(par.pp - 1) * send, s=(par.pp - 1) * send)
            total += (par.pp - 1) * send
            stage += send
        if hw.eff.iteration_s:
            ops["iteration"] = OpCost("iteration", s=hw.eff.iteration_s, note="scheduling, sampling, framework")
            total += hw.eff.iteration_s
            stage += hw.eff.iteration_s / par.pp
        parts = [f"{len(chunks)} prefill chunk(s) of {sum(c.tokens for c in chunks)} tokens"] if chunks else []
        parts += [f"{num_decodes} decode(s) over {decode_kv_tokens} KV tokens"] if num_decodes else []
        what = f"{m.name} on {hw.name} {par.label()}: {', '.join(parts)}"
        order = [
            *LAYER_OPS,
            "sp_ring",
            "sp_alltoall",
            "sp_allgather",
            "kvp_exchange",
            "tp_allreduce",
            "lm_head",
            "pp_send",
        ]
        ordered = tuple(ops[k] for k in [*order, "iteration"] if k in ops)
        return Breakdown(what, ordered, total, stage_s=stage if par.pp > 1 else None)

    # ---- queries --------------------------------------------------------------------------------------
    def step(
        self,
        chunks: Sequence[Chunk] = (),
        decode_contexts: Sequence[int] = (),
        par: Parallelism = SINGLE,
        keep: float = 1.0,
    ) -> Breakdown:
        """One iteration of a mixed batch: prefill chunks and decodes (one token each over its context)."""
        return self.iteration(tuple(chunks), len(decode_contexts), int(sum(decode_contexts)), par, keep)

    def microbatched(
        self, chunks: Sequence[Chunk], decode_contexts: Sequence[int], par: Parallelism, microbatches: int
    ) -> Breakdown:
        """A batch split into `microbatches` that flow through the PP stages one after another: each stage runs
        every micro-batch, so the batch takes (microbatches + pp - 1) stage times (the pp - 1 are the bubble);
        `stage_s` is one micro-batch's stage time. The parts are given whole and dealt out round-robin."""
        if microbatches < 1 or microbatches > max(1, len(chunks) + len(decode_contexts)):
            raise ValueError(f"microbatches must be in [1, batch size], got {microbatches}")
        parts = [self.step(chunks[i::microbatches], decode_contexts[i::microbatches], par) for i in range(microbatches)]
        stage = max(p.stage_s if p.stage_s is not None else p.total_s for p in parts)
        total = (microbatches + par.pp - 1) * stage
        ops: dict[str, OpCost] = {}
        for p in parts:
            for o in p.ops:
                ops[o.name] = ops[o.name].plus(o) if o.name in ops else o
        work = sum(o.s for o in ops.values())
        scaled = tuple(o.scaled(total / work) for o in ops.values())  # the bubble spread over the ops alike
        what = f"{parts[0].what.split(':')[0]}: {microbatches} micro-batches over {par.pp} stage(s)"
        return Breakdown(what, scaled, total, stage_s=stage)

    def decode(self, batch: int, context: int, par: Parallelism = SINGLE) -> Breakdown:
        """One decode step of `batch` requests, each over `context` cached tokens."""
        if batch < 1 or context < 0:
            raise ValueError(f"decode needs batch >= 1 and context >= 0, got {batch}, {context}")
        return self.iteration((), batch, batch * context, par, 1.0)

    def multi_master_decode(self, batch: int, context: int, par: Parallelism = SINGLE) -> Breakdown:
        """One decode step of `batch` requests on a group of `par.kvp` instances that each master a share of
        them (LoongServe's multi-master distributed decoding): each runs the dense layers of its share, and the
        attention of every request is split over the members holding its KV (the query exchange as KVP's)."""
        if batch < 1 or context < 0:
            raise ValueError(f"decode needs batch >= 1 and context >= 0, got {batch}, {context}")
        return self.iteration((), math.ceil(batch / par.kvp), batch * context, par, 1.0)

    def prefill(
        self,
        tokens: int,
        history: int = 0,
        par: Parallelism = SINGLE,
        chunk_size: int | None = None,
        keep: float = 1.0,
    ) -> Breakdown:
        """A prompt's prefill, whole or in chunks of `chunk_size` (on PP stages the chunks pipeline: SPP)."""
        if chunk_size is None or chunk_size >= tokens:
            return self.iteration((Chunk(tokens, history),), 0, 0, par, keep)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return self._chunked(tokens, history, par, chunk_size, keep)

    def _chunked_prefill(self, tokens: int, history: int, par: Parallelism, chunk_size: int, keep: float) -> Breakdown:
        steps = []
        for start in range(0, tokens, chunk_size):
            steps.append(self.iteration((Chunk(min(chunk_size, tokens - start), history + start),), 0, 0, par, keep))
        ops: dict[str, OpCost] = {}
        for st in steps:
            for o in st.ops:
                ops[o.name] = ops[o.name].plus(o) if o.name in ops else o
        if par.pp == 1:
            total, stage = sum(st.total_s for st in steps), None
        else:
            finish = [0.0] * par.pp  # each stage's finish time of the latest chunk
            for st in steps:
                for j in range(par.pp):
                    finish[j] = max(finish[j], finish[j - 1] if j else 0.0) + st.stage_s  # type: ignore[operator]
            total, stage = finish[-1], sum(st.stage_s or 0.0 for st in steps)
            work = sum(st.total_s for st in steps)
            ops = {k: o.scaled(total / work) for k, o in ops.items()}  # the pipeline overlaps each op alike
        what = f"{self.model.name} on {self.hw.name} {par.label()}: prefill {tokens} tokens in {len(steps)} chunks"
        return Breakdown(what, tuple(ops.values()), total, stage_s=stage)

    # ---- memory and movement ----------------------------------------------------------------------------
    def memory(self, par: Parallelism = SINGLE, kv_tokens: int = 0, batch_tokens: int = 0) -> MemoryPlan:
        """Bytes per GPU: weight shard, KV for `kv_tokens` spread over the instance, activations of a batch."""
        return memory_plan(self.model, self.hw, par, kv_tokens, batch_tokens, self.mem_utilization)

    def max_kv_tokens(self, par: Parallelism = SINGLE, batch_tokens: int = 8192) -> int:
        """KV tokens one instance holds after its weights and a batch's activations (0 if the weights don't fit)."""
        return self.memory(par, 0, batch_tokens).kv_capacity_tokens

    def kv_transfer_s(self, tokens: int, senders: int = 1, spans_nodes: bool = True) -> float:
        """A prompt's KV from one instance to another, `senders` GPUs sending their shares in parallel."""
        per_sender = tokens * self.model.kv_bytes_per_token / max(1, senders)
        return self.hw.link(spans_nodes).transfer_s(per_sender)

    def swap_s(self, tokens: int, gpus: int = 1) -> float:
        """KV of `tokens` between GPU and host memory (Seesaw's CPU tier, preemption), over `gpus` PCIe links."""
        return self.hw.host.transfer_s(tokens * self.model.kv_bytes_per_token / max(1, gpus))

    def reshard_s(self, par: Parallelism) -> float:
        """Loading each GPU's weight shard for `par` from host memory (Seesaw's re-sharding)."""
        return self.hw.host.transfer_s(self.model.weight_bytes / (par.tp * par.pp))
