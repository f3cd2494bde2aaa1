"""Triton kernels with the same signatures and semantics as the torch reference in `spindle_attention`.

Importing this package never needs triton: kernels are jitted on their first launch, which raises a
RuntimeError when triton is missing or the tensors are neither on CUDA nor on CPU under `TRITON_INTERPRET=1`
(triton's interpreter, which reads that variable when a kernel is first launched).

Differences from the reference: `attention_fwd` does not take explicit `q_positions`/`k_positions`
(NotImplementedError), and `block_q`/`block_k` are the kernels' tile sizes (powers of two >= 16).
"""

from ._jit import available
from .attention_fwd import attention_fwd
from .merge import merge_attn_states, merge_attn_states_many
from .paged_decode import paged_decode
from .paged_prefill import paged_prefill

__all__ = [
    "attention_fwd",
    "available",
    "merge_attn_states",
    "merge_attn_states_many",
    "paged_decode",
    "paged_prefill",
]
