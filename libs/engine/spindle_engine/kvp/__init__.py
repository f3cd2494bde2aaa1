"""KV-parallel (KVP) multi-master decode: a request's KV split by token ranges over several decode members.

- `plan`: per-request ranges, master and tail; append and scale-up (existing KV never moves).
- `shard.KVShard`: one member's paged store of its ranges; partial attention `(out, lse)` over them.
- `context.KVPAttentionContext`: the per-layer exchange (q and the new k/v out, partial states back, merge).
- `decoder.KVPMember`: one member's lockstep decode loop (masters some requests, serves the rest).
"""

from .context import KVP_TAG, KVPAttentionContext, KVPStats
from .decoder import KVPMember, KVPOutput
from .plan import KVPPlan, KVPRequest, KVRange, parse_bounds, proportional_bounds
from .shard import KVShard

__all__ = [
    "KVP_TAG",
    "KVPAttentionContext",
    "KVPMember",
    "KVPOutput",
    "KVPPlan",
    "KVPRequest",
    "KVPStats",
    "KVRange",
    "KVShard",
    "parse_bounds",
    "proportional_bounds",
]
