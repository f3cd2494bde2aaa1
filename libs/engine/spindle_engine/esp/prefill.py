"""A directed request's prompt computed by an elastic group in one sequence-parallel pass, with proactive
scale-down (LoongServe §4.1): as the ring passes the KV around, each member keeps the range the plan gives it,
so no KV moves afterwards and the request decodes on those members (multi-master, decode.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from spindle_attention.distributed.comm import waiting_with

from ..engine import Engine
from ..sp import SPChunk, SPPlan, SPPrefill
from . import parts
from .exchange import Tags, Waiter

LAYOUT = "zigzag"  # ring attention, balanced over the causal mask


def shard_tokens(num_tokens: int, group: int, member: int) -> int:
    """Prompt tokens `member` computes in the pass (its zigzag shard)."""
    return SPChunk(0, num_tokens, tuple(range(group)), LAYOUT).shard_positions()[member].numel()


@torch.inference_mode()
def prefill_part(
    engine: Engine,
    request_id: str,
    me: int,
    ranks: list[int],
    retain: dict[int, tuple[int, int]],
    tags: Tags,
    waiter: Waiter,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Compute the whole prompt of directed `request_id` over the group (`ranks`, member = index), every member
    calling this with the same arguments but `me`. `retain` maps members to the prompt range `[start, end)` each
    keeps (tiling the prompt). Returns the prompt's last logits `[vocab]` on the member that computed that token
    (else None), and the positions `[n]` and KV `[2, layers, n, Hkv, D]` this member keeps, outside the cache:
    `keep` writes them. The pass's own blocks are given back, also when it fails (a member died)."""
    seq = engine.directed[request_id]
    assert not seq.block_table and seq.num_computed_tokens == 0, f"{request_id} was prefilled already"
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    plan = SPPlan((SPChunk(0, len(prompt), tuple(range(len(ranks))), LAYOUT),))
    ranges = {m: torch.arange(s, e) for m, (s, e) in retain.items()}
    sp = SPPrefill(
        engine.model, engine.cache, engine.allocator, request_id, prompt, plan, me, dict(enumerate(ranks)), ranges,
        defer_retained=True, tag_base=tags.base,
    )  # fmt: skip
    with waiting_with(waiter.wait):
        logits = sp.run()
    assert sp.retained is not None and not sp.held.table
    return logits, *sp.retained


def keep(engine: Engine, request_id: str, positions: Tensor, kv: Tensor) -> None:
    """Write the range this member retained of a prompt's KV into its blocks: the prompt is computed."""
    seq = engine.directed[request_id]
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.kv_positions = torch.empty(0, dtype=torch.int64)
    if positions.numel():
        parts.import_kv(engine, seq, positions, kv)
