"""`single`: one prefill instance per request, then one decode instance (no sequence parallelism).

Prefill goes to the instance with the least predicted queue (prompt tokens waiting there, counting what
was planned since its last heartbeat); decode goes by freeness (placement.pick_decode), over several
members of a KV-parallel group when `kvp_tokens` splits a long prompt's KV (placement.pick_decode_group).
Needs no latency model, so it runs on the real stack without a profile. `preempt_after_s` > 0 time-slices
full decode instances (preemption.py), as in the other disaggregated strategies.
"""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ..actions import Action, Admit, Reject, RunPrefill, whole_prompt
from ..state import ClusterState
from ..strategy import Strategy, register_strategy
from .placement import kvstore_id, pick_decode_group


@register_strategy("single")
class SingleInstanceStrategy(Strategy):
    tuning = {"prefill_share": (0.25, 0.5, 0.625, 0.75)}  # noqa: RUF012

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        prefills = state.live("prefill")
        placed = pick_decode_group(state, spec, self.kvp_tokens) if prefills else None
        if not prefills or placed is None:
            return [Reject(spec.request_id, 503, "no live prefill or decode instance")]
        decode, shards = placed
        prefill = min(prefills, key=lambda i: (i.predicted_queue_tokens, i.info.rank))
        prefill.planned_tokens += spec.prompt.num_tokens
        group = (prefill.id,)
        return [
            Admit(spec.request_id, group, decode.id),
            RunPrefill(spec, whole_prompt(spec, group), decode.id, kvstore_id(state), shards),
        ]
