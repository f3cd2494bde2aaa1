"""`chunked`: colocated (elastic) instances that mix prompt chunks into their decode batches under a per-step
token budget, FCFS (Sarathi-Serve / vLLM chunked prefill). No sequence parallelism and no KV transfer.

Each request goes to the elastic instance with the fewest prompt tokens waiting (ties: most free KV). Each step
of an instance takes its running decodes first, then pieces of the prompts it is prefilling, then waiting prompts,
until `chunk_size` tokens (the step's token budget: vLLM's `max_num_batched_tokens`, Sarathi-Serve's token budget;
default 2,048, vLLM's for online serving and `spindle up`'s elastic instances) are taken, so one step may pack
several prompts' chunks. On the services, `spindle_elastic` is that instance: its
engine batches so, with the budget `spindle up` sets to the same `chunk_size`; the simulator's colocated
instances do too (sim/colocated_side.py). The plan's chunks name the budget; the instance cuts the prompt by what
is left of it in each step.
"""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ..actions import Action, Admit, Reject, RunPrefill, fixed_chunks
from ..latency import LatencyModel
from ..state import ClusterState
from ..strategy import Strategy, register_strategy
from .placement import reserve_blocks


@register_strategy("chunked")
class ChunkedPrefillStrategy(Strategy):
    tuning = {"decode_tp": (1, 2, 4), "chunk_size": (512, 2048, 8192)}  # noqa: RUF012
    takes_decode_options = False
    colocated = True
    keeps_kv_in_place = True

    def __init__(self, latency: LatencyModel | None = None, *, chunk_size: int = 2048) -> None:
        super().__init__(latency)
        if chunk_size < 1:
            raise ValueError(f"chunked: chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.step_token_budget = chunk_size

    def options(self) -> dict[str, object]:
        return {"chunk_size": self.chunk_size}

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        elastic = state.live("elastic")
        if not elastic:
            return [Reject(spec.request_id, 503, "no live elastic (colocated) instance")]
        inst = min(elastic, key=lambda i: (i.predicted_queue_tokens, -i.free_blocks, i.info.rank))
        inst.planned_tokens += spec.prompt.num_tokens
        reserve_blocks(inst, spec)
        return [
            Admit(spec.request_id, (inst.id,), inst.id),
            RunPrefill(spec, fixed_chunks(spec, (inst.id,), self.chunk_size), inst.id),
        ]
