"""Sequence-parallel prefill on top of the engine: plans, held KV, re-balancing, the per-member runner,
and the KV hand-off to (tensor-parallel) decode.

- `plan`: chunk plans `(token range, member group, layout)`, their text form and deterministic placement.
- `runner.SPPrefill`: one member's side of a plan (ring or all-to-all attention, history, retention).
- `csa_plan`: CSPS's sparse attention (CSA) levels over a one-chunk all-to-all plan, and what it drops.
- `kv_parts`: split held KV by decode TP rank, reassemble a prompt's KV from several holders.
- `verify`: `spindle verify`, the self-check that a plan gives the single-instance result.
"""

from .csa_plan import csa_dropped_tokens, csa_levels_for
from .held_kv import HeldKV
from .kv_parts import assemble_kv, decode_heads, split_for_decode
from .plan import SP_LAYOUTS, ChunkStep, Move, SPChunk, SPPlan, rebalance_moves, retention_targets
from .runner import ChunkReport, SPPrefill

__all__ = [
    "SP_LAYOUTS",
    "ChunkReport",
    "ChunkStep",
    "HeldKV",
    "Move",
    "SPChunk",
    "SPPlan",
    "SPPrefill",
    "assemble_kv",
    "csa_dropped_tokens",
    "csa_levels_for",
    "decode_heads",
    "rebalance_moves",
    "retention_targets",
    "split_for_decode",
]
