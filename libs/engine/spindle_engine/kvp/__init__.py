"""KV-parallel (KVP) multi-master decode: a request's KV split by token ranges over several decode members.

- `plan`: per-request ranges, master and tail; append and scale-up (existing KV never moves), scale-down (a
  holder leaves, its range merges into an adjacent holder's: the one KV move).
- `shard.KVShard`: one member's paged store of its ranges; partial attention `(out, lse)` over them.
- `context.KVPAttentionContext`: the per-layer exchange (q and the new k/v out, partial states back, merge).
- `decoder.KVPMember`: one member's lockstep decode loop (masters some requests, serves the rest).
- `group.GroupPlanner`: where a group puts each request (split by a per-member token limit, master, scale-ups,
  scale-downs of small fragments).
- `lockstep.KVPLeaderEngine` / `follower.KVPFollower`: a group of member processes driven as one decode engine
  (the control channel is wire.py); what `spindle up --decode-kvp K` runs.
"""

from .context import KVP_TAG, KVPAttentionContext, KVPStats
from .decoder import KVPMember, KVPOutput
from .group import GroupConfig, GroupPlanner, ScaleUps
from .plan import KVPPlan, KVPRequest, KVRange, parse_bounds, proportional_bounds
from .shard import KVShard

__all__ = [
    "KVP_TAG",
    "GroupConfig",
    "GroupPlanner",
    "KVPAttentionContext",
    "KVPMember",
    "KVPOutput",
    "KVPPlan",
    "KVPRequest",
    "KVPStats",
    "KVRange",
    "KVShard",
    "ScaleUps",
    "parse_bounds",
    "proportional_bounds",
]
