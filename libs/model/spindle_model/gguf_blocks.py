"""Serve a GGUF model's small-batch matmuls from the file's quantized blocks.

A model loaded from GGUF computes with the dequantized float32 weights. Decode steps are bound by reading those
weights (4 bytes each); the file holds the same values in Q4_1 / Q8_0 blocks of 0.625 / 1.06 bytes per weight.
`attach_gguf_blocks` hands each Linear (and the LM head) a `GGUFPackedWeight` of its tensor's blocks, which the
small-batch kernel dequantizes in registers to exactly the float32 values the model holds, so outputs are bit
for bit those of the float32 kernel. Large batches (prefill) keep using the float32 weight.

Row order: llama.cpp stores Q/K rows with rotary pairs interleaved, which is exactly the layout Spindle's
`interleave_rows` gives the fused QKV projection, so the file's rows are used as they are.
Only whole (unsharded) float32 models on CPU qualify; other tensor types keep the float32 path.
"""

from __future__ import annotations

import logging
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from spindle_attention import cpu

from .linear import Linear, SmallBatchWeight
from .llama import LlamaModel

log = logging.getLogger("spindle.model")

_LAYER_PARTS = {  # Linear attribute -> GGUF tensors whose rows it stacks
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


_GGML_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # ggml type ids; others are not block formats we take
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


class GGUFTensor(NamedTuple):
    kind: str  # ggml type name, e.g. "Q4_1" ("other" for types without a kernel)
    rows: int
    cols: int
    offset: int  # from the start of the file


def read_gguf_index(path: Path) -> dict[str, GGUFTensor]:
    """Name -> type, shape and file offset of every tensor of a GGUF (v2/v3) file; skips the metadata values.

    gguf's GGUFReader parses every metadata value (the whole vocabulary) in Python, seconds for a small model;
    this reads only what locating the tensors needs."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as head:
        return _parse_index(path, head)


def _parse_index(path: Path, head: mmap.mmap) -> dict[str, GGUFTensor]:
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from(fmt, head, pos)
        pos += struct.calcsize(fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = take("<Q")
        pos += n
        if pos > len(head):
            raise struct.error("string past the end of the file")
        return head[pos - n : pos].decode("utf-8", "replace")

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype in _SCALARS:
            pos += _SCALARS[vtype]
        elif vtype == 8:
            string()
        elif vtype == 9:
            etype, count = take("<IQ")
            if etype in _SCALARS:
                pos += _SCALARS[etype] * count
            else:
                for _ in range(count):
                    skip_value(etype)
        else:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

    try:
        magic, version, n_tensors, n_kv = take("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        alignment = 32
        for _ in range(n_kv):
            key = string()
            (vtype,) = take("<I")
            if key == "general.alignment" and vtype == 4:
                (alignment,) = take("<I")
            else:
                skip_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = take("<I")
            dims = take(f"<{n_dims}Q")
            ggml_type, offset = take("<IQ")
            rows = 1
            for d in dims[1:]:
                rows *= d
            infos.append((name, _GGML_TYPES.get(ggml_type, "other"), rows, dims[0], offset))
    except struct.error as e:
        raise ValueError(f"{path}: truncated GGUF header") from e
    start = -(-pos // alignment) * alignment
    return {name: GGUFTensor(kind, rows, cols, start + off) for name, kind, rows, cols, off in infos}


def _blocks(
    path: Path, index: dict[str, GGUFTensor], names: list[str], in_features: int
) -> cpu.GGUFPackedWeight | None:
    """One packed weight from the stacked rows of `names`, or None when they are not all one supported type."""
    parts = [index.get(n) for n in names]
    if any(p is None or p.kind not in cpu.gemm.GGUF_FORMATS or p.cols != in_features for p in parts):
        return None
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    row_bytes = in_features // cpu.gemm.GGUF_BLOCK * cpu.gemm.GGUF_FORMATS[kind][1]
    raw = np.concatenate(
        [np.fromfile(path, dtype=np.uint8, count=p.rows * row_bytes, offset=p.offset).reshape(p.rows, row_bytes)
         for p in parts]
    )  # fmt: skip
    return cpu.GGUFPackedWeight(raw, kind, in_features)


def _attach(small: SmallBatchWeight, packed: cpu.GGUFPackedWeight | None, weight: torch.Tensor) -> bool:
    if packed is None or (packed.out_features, packed.in_features) != tuple(weight.shape):
        return False
    small.use(packed)
    return True


def attach_gguf_blocks(model: LlamaModel, gguf_path: Path) -> int:
    """Give `model`'s linears the file's quantized blocks; returns how many took them (0 when none qualify)."""
    if not cpu.available() or model.dtype != torch.float32 or model.device.type != "cpu" or model.shard.world > 1:
        return 0
    index = read_gguf_index(gguf_path)
    attached = total = 0
    for layer in model.layers:
        for attr, parts in _LAYER_PARTS.items():
            linear: Linear = getattr(layer, attr)
            names = [f"blk.{layer.layer_id}.{p}.weight" for p in parts]
            total += 1
            attached += _attach(linear.small, _blocks(gguf_path, index, names, linear.weight.shape[1]), linear.weight)
    if model.is_last:
        head = "token_embd.weight" if model.lm_head is model.embed_tokens else "output.weight"
        total += 1
        attached += _attach(
            model._lm_head_small, _blocks(gguf_path, index, [head], model.config.hidden_size), model.lm_head
        )
    log.info("decode matmuls read GGUF blocks for %d of %d weights (%s)", attached, total, gguf_path.name)
    return attached
