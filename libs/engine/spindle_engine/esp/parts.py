"""The part of a directed request's KV one elastic instance holds, in the engine's paged cache.

Entry i of a sequence sits in slot `block_table[i // bs] * bs + i % bs` (as for any sequence); its absolute
position is `kv_positions[i]`, or i when `kv_positions` is None (the whole KV, in order, as the engine's own
steps keep it). A member of an elastic group may hold any positions of a request: the range it retained after
a sequence-parallel prefill, the tokens it decoded as the request's master, or nothing at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine import Engine
from ..kv_cache import KVCache
from ..sampling_params import SamplingParams
from ..sequence import Sequence, SequenceStatus


def num_entries(seq: Sequence) -> int:
    return seq.num_computed_tokens if seq.kv_positions is None else seq.kv_positions.numel()


def positions(seq: Sequence) -> Tensor:
    """`[n]` absolute positions of the entries held here, in table order."""
    return torch.arange(seq.num_computed_tokens) if seq.kv_positions is None else seq.kv_positions


def slots(seq: Sequence, block_size: int) -> Tensor:
    """`[n]` flat cache slots of the entries held here."""
    i = torch.arange(num_entries(seq))
    table = torch.tensor(seq.block_table, dtype=torch.int64)
    return table[i // block_size] * block_size + i % block_size if i.numel() else i


def set_positions(seq: Sequence, pos: Tensor) -> None:
    """Record the entries' positions; the whole prompt-and-outputs KV in order goes back to the plain form."""
    n = pos.numel()
    whole = n == seq.num_computed_tokens and torch.equal(pos, torch.arange(n))
    seq.kv_positions = None if whole else pos.to(torch.int64)


def append_entry(engine: Engine, seq: Sequence, position: int) -> int:
    """One more entry (allocated, not written) for `position`; returns its slot. OutOfBlocksError if no room.
    The entry counts from now on, before `num_computed_tokens` does (`set_positions` after advancing it)."""
    n, bs = num_entries(seq), engine.config.block_size
    engine.allocator.allocate(seq.request_id, n + 1, seq.block_table)
    seq.kv_positions = torch.cat([positions(seq), torch.tensor([position])])  # plain again once it is computed
    return seq.block_table[n // bs] * bs + n % bs


def room_for(engine: Engine, seq: Sequence, tokens: int) -> bool:
    return engine.allocator.can_allocate(num_entries(seq) + tokens, seq.block_table)


def read(cache: KVCache, layer: int, entry_slots: Tensor) -> tuple[Tensor, Tensor]:
    """k, v `[n, Hkv, D]` of the given slots in `layer` (local layer index)."""
    k, v = cache.k[layer], cache.v[layer]  # [blocks, bs, Hkv, D]
    entry_slots = entry_slots.to(k.device)  # index ops on a GPU cache take indices on the GPU
    return k.flatten(0, 1).index_select(0, entry_slots), v.flatten(0, 1).index_select(0, entry_slots)


def write(cache: KVCache, layer: int, entry_slots: Tensor, k: Tensor, v: Tensor) -> None:
    entry_slots = entry_slots.to(cache.k.device)
    cache.k[layer].flatten(0, 1).index_copy_(0, entry_slots, k)
    cache.v[layer].flatten(0, 1).index_copy_(0, entry_slots, v)


def export_kv(engine: Engine, seq: Sequence) -> tuple[Tensor, Tensor]:
    """The entries held here: positions `[n]` and KV `[2, layers, n, Hkv, D]` (a copy)."""
    s = slots(seq, engine.config.block_size).to(engine.cache.k.device)
    k = engine.cache.k.flatten(1, 2).index_select(1, s)
    v = engine.cache.v.flatten(1, 2).index_select(1, s)
    return positions(seq).clone(), torch.stack([k, v])


def import_kv(engine: Engine, seq: Sequence, pos: Tensor, kv: Tensor) -> None:
    """Add entries (positions `[n]`, KV `[2, layers, n, Hkv, D]`) after those held here. OutOfBlocksError (and
    nothing changed) when they do not fit."""
    n0, n = num_entries(seq), pos.numel()
    assert kv.shape[2] == n, f"{n} positions but KV of {kv.shape[2]} tokens"
    before = positions(seq)
    engine.allocator.allocate(seq.request_id, n0 + n, seq.block_table)
    seq.kv_positions = torch.cat([before, pos.to(torch.int64)])
    s = slots(seq, engine.config.block_size)[n0:]
    for layer in range(kv.shape[1]):
        write(engine.cache, layer, s, kv[0, layer].to(engine.cache.k.dtype), kv[1, layer].to(engine.cache.v.dtype))
    set_positions(seq, seq.kv_positions)


def new_sequence(
    engine: Engine,
    request_id: str,
    token_ids: list[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    num_computed: int | None = None,
) -> Sequence:
    """A directed sequence joining this member with no KV here yet: the KV of its first `num_computed` tokens sits
    on other members (default: all but the last token's, which is still to compute: mid-decode)."""
    engine._check_new_id(request_id)
    seq = Sequence(request_id, list(token_ids), params, num_prompt_tokens=num_prompt_tokens)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(token_ids) - 1 if num_computed is None else num_computed
    seq.kv_positions = torch.empty(0, dtype=torch.int64)
    engine.directed[request_id] = seq
    return seq


def drop(engine: Engine, request_id: str, reason: str = "abort") -> None:
    """Forget a directed request here and free its blocks (nothing when it is not here)."""
    seq = engine.directed.pop(request_id, None)
    if seq is not None:
        engine.allocator.free(request_id, seq.block_table)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
