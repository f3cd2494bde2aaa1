"""Elastic sequence parallelism (LoongServe): what an elastic instance runs when the cluster scheduler names each
iteration of a group of instances, on the engine's directed requests (`Engine.add_directed`).

- `parts`: the part of a request's KV one member holds (any positions; `Sequence.kv_positions`), its export and
  import (KV migration).
- `prefill.prefill_part`: a prompt over the whole group in one ring pass, each member retaining its range
  (proactive scale-down, §4.1).
- `decode.multi_master_step`: one multi-master step: decodes (LoongServe §4.2) and prompt chunks (Medha's KV
  parallelism, §3.4), each request's master running its dense layers over its new tokens and keeping their KV,
  every member that holds earlier KV of it attending its queries over that.
- `iteration.run_iteration`: one iteration as every member runs it (agree on what runs, hand requests over to
  new masters, prefill, decode, share the sampled tokens).
- `exchange`: the point-to-point messages and tags.
"""

from .exchange import ESPError
from .iteration import ChunkWork, DecodeWork, ESPOutput, Flag, IterationResult, PrefillWork, run_iteration

__all__ = [
    "ChunkWork", "DecodeWork", "ESPError", "ESPOutput", "Flag", "IterationResult", "PrefillWork", "run_iteration",
]  # fmt: skip
