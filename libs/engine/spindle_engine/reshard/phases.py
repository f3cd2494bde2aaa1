"""One rank's two phases of a re-sharded request: the prompt through a pipeline (`PPa[xTPb]`) with every layer's
KV swapped out to the host tier while the next layers compute, then greedy decode tensor-parallel (`TPc`) over the
KV swapped back in by a prefetcher thread, layer by layer, while the first step already runs (Seesaw §5.2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel, ModelConfig
from spindle_model.llama import CausalAttention

from .config import Parallel
from .host_kv import HostKV

HIDDEN_TAG = 77  # the pipeline's hidden states, stage to stage


@dataclass
class Loaded:
    model: LlamaModel
    bytes: int  # copied out of the host weights into the model
    seconds: float


@torch.inference_mode()
def load(config: ModelConfig, dtype: torch.dtype, par: Parallel, rank: int, weights: Mapping[str, Tensor]) -> Loaded:
    """This rank's shard of the model in configuration `par`, built from the shared host weights."""
    t0 = time.perf_counter()
    stage, _ = par.position(rank)
    group = RankGroup(par.stage_ranks(stage)) if par.tp > 1 else None
    model = LlamaModel(config, dtype=dtype, layer_range=par.layers(stage, config.num_layers), tp_group=group)
    model.load_weights(weights)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Loaded(model.eval(), nbytes, time.perf_counter() - t0)


class SwapOut:
    """Pushes each layer's KV to the host tier on a background thread as soon as the layer has computed it."""

    def __init__(self, store: HostKV, heads: tuple[int, int]) -> None:
        self.store, self.heads = store, heads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="swap-out")
        self._pending: list[Future] = []
        self.busy_s = 0.0  # time spent pushing
        self.exposed_s = 0.0  # time the prefill waited for pushes after its compute

    def __call__(self, layer: int, k: Tensor, v: Tensor) -> None:
        self._pending.append(self._pool.submit(self._push, layer, k, v))

    def _push(self, layer: int, k: Tensor, v: Tensor) -> None:
        t0 = time.perf_counter()
        self.store.push(layer, self.heads, 0, k, v)
        self.busy_s += time.perf_counter() - t0

    def drain(self) -> None:
        t0 = time.perf_counter()
        for f in self._pending:
            f.result()
        self.exposed_s += time.perf_counter() - t0
        self._pending.clear()
        self._pool.shutdown()


class _Capture:
    """Causal attention over the whole prompt; each layer's k, v go to `on_kv` first."""

    def __init__(self, on_kv: Callable[[int, Tensor, Tensor], None]) -> None:
        self.on_kv, self.causal = on_kv, CausalAttention()

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.on_kv(layer, k, v)
        return self.causal.attention(layer, q, k, v)


@torch.inference_mode()
def prefill(model: LlamaModel, par: Parallel, rank: int, token_ids: list[int], swap: SwapOut) -> Tensor:
    """The prompt through this rank's stage; returns the last prompt token's fp32 logits `[vocab]` on every rank
    (computed by the last stage, broadcast from its first rank)."""
    stage, _ = par.position(rank)
    ids = torch.tensor(token_ids)
    positions = torch.arange(len(ids))
    ctx = _Capture(lambda layer, k, v: swap(layer, k.clone(), v.clone()))
    if stage == 0:
        hidden = model(positions, ctx, input_ids=ids)
    else:
        x = torch.empty(len(ids), model.config.hidden_size, dtype=model.dtype)  # [T, H]
        dist.recv(x, rank - par.tp, tag=HIDDEN_TAG)
        hidden = model(positions, ctx, hidden=x)
    logits = torch.empty(model.config.vocab_size, dtype=torch.float32)
    if stage < par.pp - 1:
        dist.send(hidden.contiguous(), rank + par.tp, tag=HIDDEN_TAG)
    else:
        logits = model.compute_logits(hidden[-1:])[0]
    dist.broadcast(logits, (par.pp - 1) * par.tp)
    return logits


class SwapIn:
    """Pulls this rank's KV heads of every layer from the host tier on a prefetcher thread, layer by layer, into
    local caches `[heads, capacity, head_dim]` with room for the decoded tokens; `wait(layer)` blocks until that
    layer has landed."""

    def __init__(self, store: HostKV, model: LlamaModel, prompt_tokens: int, capacity: int) -> None:
        shard, d = model.shard, model.config.head_dim
        self.heads = shard.kv_heads
        h = shard.num_kv_heads
        layers = range(model.config.num_layers)
        self.k = [torch.empty(h, capacity, d, dtype=model.dtype) for _ in layers]  # [Hkv_local, cap, D] each
        self.v = [torch.empty(h, capacity, d, dtype=model.dtype) for _ in layers]
        self._ready = [threading.Event() for _ in layers]
        self.busy_s = 0.0
        self.exposed_s = 0.0  # time decode waited for a layer
        self._thread = threading.Thread(target=self._run, args=(store, prompt_tokens), name="swap-in", daemon=True)
        self._thread.start()

    def _run(self, store: HostKV, tokens: int) -> None:
        for layer in range(len(self.k)):
            t0 = time.perf_counter()
            store.pull(layer, self.heads, tokens, self.k[layer], self.v[layer])
            self.busy_s += time.perf_counter() - t0
            self._ready[layer].set()

    def wait(self, layer: int) -> None:
        if not self._ready[layer].is_set():
            t0 = time.perf_counter()
            self._ready[layer].wait()
            self.exposed_s += time.perf_counter() - t0

    def join(self) -> None:
        self._thread.join()


class _Cached:
    """Attention of new tokens over the swapped-in KV plus what decode appended (HND caches)."""

    def __init__(self, swap: SwapIn, length: int) -> None:
        self.swap, self.length = swap, length

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.swap.wait(layer)
        kc, vc = self.swap.k[layer], self.swap.v[layer]
        n, t = self.length, k.shape[0]
        kc[:, n : n + t].copy_(k.transpose(0, 1))
        vc[:, n : n + t].copy_(v.transpose(0, 1))
        out = F.scaled_dot_product_attention(  # [1, Hq, t, D]; one new token attends every cached one
            q.transpose(0, 1).unsqueeze(0), kc[None, :, : n + t], vc[None, :, : n + t], enable_gqa=True
        )[0]
        return out.transpose(0, 1)


@torch.inference_mode()
def decode(model: LlamaModel, swap: SwapIn, prompt_tokens: int, first: int, steps: int) -> tuple[list[int], Tensor]:
    """Greedy decode from the first token: (tokens incl. `first`, logits `[steps, vocab]` that chose the rest).
    Every rank computes the same logits (the TP all-reduce is bitwise equal across ranks) and the same tokens."""
    ctx = _Cached(swap, prompt_tokens)
    tokens, logits = [first], []
    for i in range(steps):
        pos = torch.tensor([prompt_tokens + i])
        hidden = model(pos, ctx, input_ids=torch.tensor([tokens[-1]]))
        ctx.length += 1
        row = model.compute_logits(hidden)[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(logits) if logits else torch.empty(0, model.config.vocab_size)
