"""Decode-only steps on CPU in one native call (`spindle_attention/cpu/llama_decode.c`).

At decode batch sizes the torch path spends more time dispatching its ~25 small operators per layer than
computing them. `CPUDecodeRunner` runs the whole layer stack for a decode-only step in C: the same small-batch
GEMMs as `Linear` (bit for bit, including GGUF blocks), the same paged decode kernel, and RMSNorm / RoPE /
SiLU in fp32 (within rounding of torch's). Embedding, final norm and LM head stay in torch (three calls).

It serves whole float32 models on CPU without tensor parallelism, up to `cpu.MAX_ROWS` sequences per step;
anything else (mixed prefill/decode steps, larger batches) runs the eager path. The CPU analogue of
`cuda_graphs.py`, and like it bound to the weights and cache it was built over (reloading weights afterwards
needs a new runner).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from spindle_attention import cpu
from spindle_model import LlamaModel

from .kv_cache import KVCache

FIELDS = 12  # per-layer entries of the table llama_decode.c reads (its LAYER_* enum)
PHASES = ("gemm", "attention", "other")  # llama_decode.c's PHASE_* (other: norms, RoPE, cache writes, SiLU)


def unsupported_reason(model: LlamaModel, cache: KVCache) -> str | None:
    """Why `CPUDecodeRunner` cannot serve this model and cache, or None when it can."""
    cfg = model.config
    if model.device.type != "cpu" or not cpu.available():
        return "not on CPU or CPU kernels unavailable"
    if model.dtype != torch.float32:
        return f"model dtype {model.dtype} (float32 only)"
    if model.shard.world > 1 or not (model.is_first and model.is_last):
        return "tensor-parallel shard or pipeline stage"
    if cfg.head_dim % 2 or model.num_local_q_heads // model.num_local_kv_heads > cpu.decode.MAX_GROUP:
        return "head layout outside the kernel's range"
    return None


class CPUDecodeRunner:
    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        if (why := unsupported_reason(model, cache)) is not None:
            raise ValueError(f"the fused CPU decode cannot serve this model: {why}")
        self.model, self.cache = model, cache
        self.lib = cpu.kernels()
        self._keep: list[object] = []  # everything the table points into
        rows = []
        for i, layer in enumerate(model.layers):
            entry = [
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                cache.k[i].data_ptr(),
                cache.v[i].data_ptr(),
            ]
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                packed = linear.small.packed(linear.weight)
                assert packed is not None  # unsupported_reason() checked the kernels and dtype
                self._keep.append(packed)
                entry += [packed.data.data_ptr(), packed.fmt]
            assert len(entry) == FIELDS
            rows.append(entry)
        self.table = torch.tensor(rows, dtype=torch.int64)  # [layers, FIELDS]
        self._cache_ptr = cache.k.data_ptr()
        self.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)  # inside the native call, cumulative

    def phases(self) -> dict[str, float]:
        """Seconds spent so far inside the native call, by phase (for profiles)."""
        return dict(zip(PHASES, self.phase_seconds.tolist(), strict=True))

    def fits(self, batch: int, table_width: int) -> bool:
        """Whether a decode step of `batch` sequences runs here (any block-table width does)."""
        return 0 < batch <= cpu.MAX_ROWS

    @torch.inference_mode()
    def run(
        self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int], tables: list[list[int]]
    ) -> Tensor:
        """One token per sequence; returns fp32 logits `[B, vocab]`."""
        assert self.cache.k.data_ptr() == self._cache_ptr, "the KV cache moved since the runner was built"
        model, cfg, cache = self.model, self.model.config, self.cache
        b = len(ids)
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # [B, W]
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        slot_t = torch.tensor(slots, dtype=torch.int64)
        x = F.embedding(torch.tensor(ids), model.embed_tokens).contiguous()  # [B, H] residual stream
        rope = torch.view_as_real(model.rotary.factors(torch.tensor(positions))).contiguous()  # [B, 1, D/2, 2]
        num_blocks, block_size, hkv, d = cache.k[0].shape
        hq = model.num_local_q_heads
        threads = torch.get_num_threads()
        splits = cpu.decode.num_splits(b, hkv, max(seq_lens), threads)
        rc = self.lib.spindle_llama_decode(
            x.data_ptr(), b, len(model.layers), self.table.data_ptr(), rope.data_ptr(), slot_t.data_ptr(),
            block_table.data_ptr(), width, lens.data_ptr(), cfg.hidden_size, hq, hkv, d,
            cfg.intermediate_size, block_size, num_blocks, cache.k.element_size(),
            float(cfg.rms_norm_eps), 1.0 / math.sqrt(d), splits, threads, self.phase_seconds.data_ptr(),
        )  # fmt: skip
        if rc == -3:
            raise IndexError(f"a slot or block id lies outside the cache's {num_blocks} blocks")
        if rc != 0:
            raise RuntimeError(f"spindle_llama_decode failed ({rc})")
        return model.compute_logits(model.norm(x))
