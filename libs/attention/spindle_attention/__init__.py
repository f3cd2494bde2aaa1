"""Spindle's attention library: exact primitives shared by every service.

The torch implementations (this package's top level) run anywhere and are the reference; the Triton
kernels in `spindle_attention.triton` implement the same signatures for GPUs and are tested against the
reference under `TRITON_INTERPRET=1`. `spindle_attention.backends` puts these, the native CPU kernels and
flash-attn behind one registry, chosen per device (`select_backend`).
"""

from .merge import merge_attn_states, merge_attn_states_many
from .paged import paged_decode, paged_prefill, slot_indices
from .reference import attention_fwd, positions

__all__ = [
    "attention_fwd",
    "merge_attn_states",
    "merge_attn_states_many",
    "paged_decode",
    "paged_prefill",
    "positions",
    "slot_indices",
]

from . import backends, distributed  # the backend registry; sequence-parallel attention over torch.distributed

__all__ += ["backends", "distributed"]
