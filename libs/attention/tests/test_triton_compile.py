"""Compile the Triton kernels for an H100 (sm_90) without a GPU.

The interpreter (test_triton_kernels.py) checks the numbers but accepts code the compiler rejects (loop-carried
type changes, unsupported ops) and never sees shared-memory limits. triton can compile to a cubin with no GPU
present, so this runs the real compiler on the default launch configurations. It runs in a subprocess because
TRITON_INTERPRET, which the kernel tests set for this process, would make the kernels interpreted.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

# find_spec, not importorskip: importing triton here, before test_triton_kernels sets TRITON_INTERPRET, would
# leave triton's own library compiled-mode for the interpreted tests.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

_SCRIPT = r"""
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if "nvidia" not in triton.backends.backends:
    print("triton has no nvidia backend")
    sys.exit(3)

import spindle_attention.triton  # noqa: F401

fwd = sys.modules["spindle_attention.triton.attention_fwd"]
dec = sys.modules["spindle_attention.triton.paged_decode"]
mrg = sys.modules["spindle_attention.triton.merge"]
H100_SMEM = 232448  # bytes of shared memory a block may use on sm_90


def compile_kernel(lazy, types, consts, num_warps, num_stages):
    fn = lazy.materialize() if hasattr(lazy, "materialize") else lazy  # jitting rebinds the module's names
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    # what a launch specialises on: 16-aligned pointers and strides
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in consts and (sig[n].startswith("*") or n.startswith("stride"))
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert kernel.metadata.shared <= H100_SMEM, (fn.fn.__name__, consts, kernel.metadata.shared)
    print(fn.fn.__name__, consts, "shared", kernel.metadata.shared)


def fwd_types(dtype):
    return {
        **{n: f"*{dtype}" for n in ("Q", "K", "V", "Out")},
        "Lse": "*fp32",
        **{n: "*i32" for n in ("cu_seqlens_q", "k_lens", "q_offsets", "k_offsets", "block_table")},
        "qk_scale": "fp32",
    }


for dtype, d, group, causal, paged in [("bf16", 128, 4, True, False), ("fp16", 64, 3, False, True)]:
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    bm, bn, warps, stages = fwd.default_blocks(d, torch_dtype, torch.device("cuda"))
    consts = dict(
        GROUP=group, HEAD_DIM=d, HEAD_DIM_PAD=d, BLOCK_M=bm, TOKENS_M=bm // group, BLOCK_N=bn, CAUSAL=causal,
        PAGED=paged, PAGE_SIZE=16 if paged else 1, DOT_PRECISION="tf32", q_stride=1, k_stride=1,
    )
    compile_kernel(fwd._attn_fwd_kernel, fwd_types(dtype), consts, warps, stages)

types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*fp32", "Lse": "*fp32", "block_table": "*i32",
         "seq_lens": "*i32", "qk_scale": "fp32"}
consts = dict(GROUP=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_H=16, BLOCK_N=64, PAGE_SIZE=16, DOT_PRECISION="tf32")
compile_kernel(dec._paged_decode_kernel, types, consts, 4, 3)

types = {"outs": "*fp32", "lses": "*fp32", "out": "*bf16", "lse": "*fp32"}
compile_kernel(mrg._merge_many_kernel, types, dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_S=16), 2, 1)
types = {"out_a": "*fp16", "lse_a": "*fp32", "out_b": "*fp16", "lse_b": "*fp32", "out": "*fp16", "lse": "*fp32"}
compile_kernel(mrg._merge2_kernel, types, dict(HEAD_DIM=128, HEAD_DIM_PAD=128), 1, 1)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
