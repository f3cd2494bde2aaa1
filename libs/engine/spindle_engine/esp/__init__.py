"""Elastic sequence parallelism (LoongServe): what an elastic instance runs when the cluster scheduler names each
iteration of a group of instances, on the engine's directed requests (`Engine.add_directed`).

- `parts`: the part of a request's KV one member holds (any positions; `Sequence.kv_positions`), its export and
  import (KV migration).
- `prefill.prefill_part`: a prompt over the whole group in one ring pass, each member retaining its range
  (proactive scale-down, §4.1).
- `decode.decode_step`: one multi-master decode step (§4.2): each request's master runs its dense layers and
  keeps its new token's KV, every member attends the queries over what it holds.
- `iteration.run_iteration`: one iteration as every member runs it (agree on what runs, hand requests over to
  new masters, prefill, decode, share the sampled tokens).
- `exchange`: the point-to-point messages and tags.
"""

from .exchange import ESPError
from .iteration import DecodeWork, ESPOutput, Flag, IterationResult, PrefillWork, run_iteration

__all__ = ["DecodeWork", "ESPError", "ESPOutput", "Flag", "IterationResult", "PrefillWork", "run_iteration"]
