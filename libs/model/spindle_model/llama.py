"""Llama-family decoder over flat token batches.

Inputs are flat: `[tokens]` ids and `[tokens]` positions, several sequences packed together; the model
itself never looks across tokens. The only cross-token operation, attention, is delegated to an
`AttentionContext` that the caller passes in (the engine's paged context, a sequence-parallel ring, a
KV-parallel group, ...), so parallel attention replaces local attention without touching this file.

One object may hold a pipeline stage (a contiguous `layer_range`; the first stage embeds, the last one
normalises and owns the LM head) and a tensor-parallel shard (`tp_group`): QKV and gate/up are
column-parallel (fused), o_proj and down are row-parallel followed by an all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from spindle_attention import cpu
from spindle_attention.distributed.comm import RankGroup

from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding, apply_rope, interleave_rows
from .linear import Linear, SmallBatchWeight
from .parallel import TPShard, all_reduce_, tp_rank_world

TPGroup = dist.ProcessGroup | RankGroup | None


class AttentionContext(Protocol):
    """Computes attention for one layer of the current forward pass.

    q `[tokens, q_heads, head_dim]` and k/v `[tokens, kv_heads, head_dim]` are this rank's heads, already
    rotated. Implementations store k/v where they need them and return `[tokens, q_heads, head_dim]`.
    Rotary pairs are interleaved (see `layers.RotaryEmbedding`), so q/k head dims are a fixed per-head
    permutation of Hugging Face's; anything that moves K between Spindle processes keeps that layout.
    """

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class CausalAttention:
    """Plain causal attention over one sequence held entirely in this forward pass (no cache)."""

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # [1, heads, tokens, head_dim]: the 4-D form is what selects the CPU flash kernel
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
        )[0]
        return out.transpose(0, 1)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    WEIGHTS = (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        shard: TPShard,
        dtype: torch.dtype,
        tp_group: TPGroup,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.shard = shard
        self.tp_group = tp_group
        d, h = config.head_dim, config.hidden_size
        self.num_q, self.num_kv, self.head_dim = shard.num_q_heads, shard.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear((self.num_q + 2 * self.num_kv) * d, h, dtype, device)
        self.o_proj = Linear(h, self.num_q * d, dtype, device)
        ffn = shard.ffn[1] - shard.ffn[0]
        self.gate_up_proj = Linear(2 * ffn, h, dtype, device)
        self.down_proj = Linear(h, ffn, dtype, device)

    def forward(self, x: Tensor, rope: Tensor, ctx: AttentionContext) -> Tensor:
        t, d, nq, nkv = x.shape[0], self.head_dim, self.num_q, self.num_kv
        qkv = self.qkv_proj(self.input_layernorm(x))  # [T, (Hq + 2 Hkv) * D]
        qk = apply_rope(qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d), rope)  # q and k rotated together
        v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
        attn = ctx.attention(self.layer_id, qk[:, :nq], qk[:, nq:], v)  # [T, Hq, D]
        x = x + all_reduce_(self.o_proj(attn.reshape(t, -1)), self.tp_group)
        gate_up = self.gate_up_proj(self.post_attention_layernorm(x))  # [T, 2 * ffn]
        act = cpu.elementwise.silu_mul(gate_up)  # one pass on CPU (None elsewhere)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return x + all_reduce_(self.down_proj(act), self.tp_group)

    def load_weights(self, w: Mapping[str, Tensor]) -> None:
        """Take this layer's slice of full HF-named weights (`prefix` already stripped)."""
        d, s = self.head_dim, self.shard
        q = w["self_attn.q_proj.weight"][s.q_heads[0] * d : s.q_heads[1] * d]
        k = w["self_attn.k_proj.weight"][s.kv_heads[0] * d : s.kv_heads[1] * d]
        v = w["self_attn.v_proj.weight"][s.kv_heads[0] * d : s.kv_heads[1] * d]
        self.qkv_proj.weight.copy_(
            torch.cat([interleave_rows(q, s.num_q_heads), interleave_rows(k, s.num_kv_heads), v])
        )
        self.o_proj.weight.copy_(w["self_attn.o_proj.weight"][:, s.q_heads[0] * d : s.q_heads[1] * d])
        lo, hi = s.ffn
        self.gate_up_proj.weight.copy_(torch.cat([w["mlp.gate_proj.weight"][lo:hi], w["mlp.up_proj.weight"][lo:hi]]))
        self.down_proj.weight.copy_(w["mlp.down_proj.weight"][:, lo:hi])
        self.input_layernorm.weight.copy_(w["input_layernorm.weight"])
        self.post_attention_layernorm.weight.copy_(w["post_attention_layernorm.weight"])
        for linear in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
            linear.pack()


class LlamaModel(nn.Module):
    """A Llama decoder, or one pipeline stage / tensor-parallel shard of it."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        layer_range: tuple[int, int] | None = None,
        tp_group: TPGroup = None,
        device: torch.device | str | None = None,
    ) -> None:
        """`device`: where the parameters are created (default CPU); `load_weights` copies CPU tensors there."""
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        start, end = layer_range if layer_range is not None else (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer_range {layer_range} is not a non-empty range within [0, {config.num_layers}]")
        self.config = config
        self.dtype = dtype
        self.layer_range = (start, end)
        self.is_first = start == 0
        self.is_last = end == config.num_layers
        tp_rank, tp_world = tp_rank_world(tp_group)
        self.shard = TPShard.create(config, tp_rank, tp_world)
        self.rotary = RotaryEmbedding(config, device)
        embed = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device) if self.is_first else None
        self.embed_tokens = embed
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.shard, dtype, tp_group, device) for i in range(start, end)
        )
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Parameter | None = None
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
            tied = config.tie_word_embeddings and self.embed_tokens is not None
            head = None if tied else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
            self.lm_head = self.embed_tokens if tied else head
        self._lm_head_small = SmallBatchWeight()

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    @property
    def num_local_q_heads(self) -> int:
        return self.shard.num_q_heads

    @property
    def num_local_kv_heads(self) -> int:
        return self.shard.num_kv_heads

    def forward(
        self,
        positions: Tensor,
        ctx: AttentionContext,
        *,
        input_ids: Tensor | None = None,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """positions `[T]`; `input_ids [T]` on the first stage, else `hidden [T, H]` from the previous stage.

        Returns hidden states `[T, H]`, normalised by the final norm on the last stage.
        """
        if self.is_first:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            x = F.embedding(input_ids, self.embed_tokens)
        else:
            if hidden is None:
                raise ValueError("a later pipeline stage needs the previous stage's hidden states")
            x = hidden
        rope = self.rotary.factors(positions)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x) if self.is_last else x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Final-norm hidden states `[N, H]` -> fp32 logits `[N, vocab]` (last stage only)."""
        if not self.is_last:
            raise ValueError("only the last pipeline stage computes logits")
        if (logits := self._lm_head_small.linear(hidden, self.lm_head, torch.float32)) is not None:
            return logits
        return F.linear(hidden, self.lm_head).float()

    def required_weights(self) -> list[str]:
        """HF names of the full tensors this stage reads."""
        names = ["model.embed_tokens.weight"] if self.is_first else []
        for layer in self.layers:
            names += [f"model.layers.{layer.layer_id}.{n}" for n in DecoderLayer.WEIGHTS]
        if self.is_last:
            names.append("model.norm.weight")
            if self.lm_head is not self.embed_tokens:
                tied = self.config.tie_word_embeddings
                names.append("model.embed_tokens.weight" if tied else "lm_head.weight")
        return names

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Load full (unsharded) HF-named weights; each rank/stage copies only its part."""
        missing = [n for n in self.required_weights() if n not in weights]
        if missing:
            raise ValueError(f"{len(missing)} weights missing from the checkpoint, e.g. {missing[:3]}")
        if self.embed_tokens is not None:
            self.embed_tokens.copy_(weights["model.embed_tokens.weight"])
        for layer in self.layers:
            prefix = f"model.layers.{layer.layer_id}."
            layer.load_weights({n: weights[prefix + n] for n in DecoderLayer.WEIGHTS})
        if self.is_last:
            self._lm_head_small.reset()
            self.norm.weight.copy_(weights["model.norm.weight"])
            if self.lm_head is not self.embed_tokens:
                self.lm_head.copy_(
                    weights["model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"]
                )
