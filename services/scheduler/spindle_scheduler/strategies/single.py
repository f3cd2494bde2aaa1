"""`single`: one prefill instance per request, then one decode instance (no sequence parallelism).

Prefill goes to the instance with the least predicted queue (prompt tokens waiting there, counting what
was planned since its last heartbeat); decode goes to the instance with the most free KV blocks.
"""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ..actions import Action, Admit, Reject, RunPrefill
from ..state import ClusterState
from ..strategy import Strategy, register_strategy


@register_strategy("single")
class SingleInstanceStrategy(Strategy):
    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        prefills = state.live("prefill")
        decodes = state.live("decode")
        if not prefills or not decodes:
            return [Reject(spec.request_id, 503, "no live prefill or decode instance")]
        prefill = min(prefills, key=lambda i: (i.predicted_queue_tokens, i.id))
        decode = max(decodes, key=lambda i: (i.free_blocks, i.id))
        n = spec.prompt.num_tokens
        prefill.planned_tokens += n
        if decode.info.block_size:
            decode.planned_blocks += -(-(n + 1) // decode.info.block_size)
        kvstores = state.live("kvstore")
        kvstore = kvstores[0].id if kvstores else ""
        return [
            Admit(spec.request_id, prefill.id, decode.id),
            RunPrefill(spec, prefill.id, decode.id, kvstore),
        ]
