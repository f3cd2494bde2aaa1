"""Communication-efficient sparse attention (CSPS §3.2.4, "CSA"): the reference, single-process.

A sequence split into the SP members' segments (SPTs, in member order: `place_by_proximity` orders the members so
that consecutive segments sit on the nearest GPUs) is treated in levels. Level 1 is a member's own segment; level v
groups 2^(v-1) consecutive segments (pairs of neighbours at level 2, ...); the last level is the whole sequence. A
query attends, at level v, the keys of its level-v segment that lie outside its level-(v-1) segment: the levels
partition every query's causal prefix, so their outputs merge exactly by their softmax denominators (the paper's
Eq. 5 is our log-sum-exp merge), and with nothing dropped CSA is dense attention. One level is plain SP (the whole
sequence, nothing dropped).

Dropping (an approximation, opt-in): at level 2 a fraction `p` of each segment's tokens is dropped, at level 2+n a
fraction min(1, 2^n p): farther regions keep fewer tokens, and p = 0 is dense attention at every level. §3.2.4
prints the rule as 1 - p = (1 - p') / 2^n, which with p the *drop* ratio keeps *more* of the farther regions (against
its own text, "a higher level ... drops more unimportant tokens so that a token attends to fewer distant tokens",
and its Fig. 8, where level 2's kept tokens include level 3's); read with p the *kept* share it is the rule we
implement by default (`rule="doubling"`), the drop ratio doubling per level. `rule="printed"` takes the formula as
printed, p and p' drop ratios: level 2+n keeps min(1, 2^n (1 - p)), so for p <= 1/2 only level 2 drops.
Within each segment the least important tokens go first, importance
being the attention the token received in the previous layer from the same (KV) head's queries (`key_importance`),
so the kept sets are nested across levels. Received attention summed over the queries that see a token ranks a
prompt's last tokens lowest (few queries come after them): by default (`per_query=True`) it is the mean over the
queries that attended the token, and (`CSAPrompt`'s default) only the queries of the token's own segment, which
each member sees without communication. A dropped token is neither a key nor a query at that level (its output there is
zero, weight zero). Level 1 never drops: a query always attends its own segment densely. First and last layers run
dense (the caller passes no importance).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .merge import merge_attn_states_many

CSA_RULES = ("doubling", "printed")  # how the drop ratio grows with the level (see the module docstring)


def max_levels(members: int) -> int:
    """Levels over `members` segments up to the whole sequence: 1 + ceil(log2(members))."""
    return 1 + math.ceil(math.log2(members)) if members > 1 else 1


@dataclass(frozen=True)
class CSALevels:
    """The levels over `segments` (each member's [start, end) of the sequence, consecutive, in sequence order)."""

    segments: tuple[tuple[int, int], ...]
    num_levels: int
    drop: float = 0.0  # p: the fraction of each segment dropped at level 2
    rule: str = "doubling"  # the drop at the levels above 2: `CSA_RULES`

    def __post_init__(self) -> None:
        if not self.segments or self.segments[0][0] != 0:
            raise ValueError("segments must start at 0")
        if any(a[1] != b[0] for a, b in itertools.pairwise(self.segments)):
            raise ValueError(f"segments must be consecutive: {self.segments}")
        if any(s >= e for s, e in self.segments):
            raise ValueError(f"every segment needs a token: {self.segments}")
        most = max_levels(len(self.segments))
        if not 1 <= self.num_levels <= most:
            raise ValueError(f"{len(self.segments)} segments take 1 to {most} levels, got {self.num_levels}")
        if not 0.0 <= self.drop < 1.0:
            raise ValueError(f"the drop ratio must be in [0, 1), got {self.drop}")
        if self.rule not in CSA_RULES:
            raise ValueError(f"the CSA level rule must be one of {', '.join(CSA_RULES)}, got {self.rule!r}")

    @classmethod
    def even(
        cls, num_tokens: int, members: int, num_levels: int | None = None, drop: float = 0.0, rule: str = "doubling"
    ) -> CSALevels:
        """Segments as even as they go (the first ones one token longer); every level by default."""
        base, extra = divmod(num_tokens, members)
        bounds = [0]
        for m in range(members):
            bounds.append(bounds[-1] + base + (m < extra))
        segments = tuple(itertools.pairwise(bounds))
        return cls(segments, max_levels(members) if num_levels is None else num_levels, drop, rule)

    @property
    def num_tokens(self) -> int:
        return self.segments[-1][1]

    def kept_fraction(self, level: int) -> float:
        """Level 1 keeps everything, level 2+n drops min(1, 2^n p) (`printed`: keeps min(1, 2^n (1 - p)))."""
        if level == 1:
            return 1.0
        if self.rule == "printed":
            return min(1.0, (1.0 - self.drop) * 2 ** (level - 2))
        return 1.0 - min(1.0, self.drop * 2 ** (level - 2))

    def kept_count(self, level: int, member: int) -> int:
        """Tokens of `member`'s segment kept at `level` (the same for every head)."""
        s, e = self.segments[member]
        return round(self.kept_fraction(level) * (e - s))

    def group(self, level: int, member: int) -> tuple[int, int]:
        """The members [first, last) of `member`'s level-`level` segment (the last level: all of them; with one
        level, CSA is off and that level is the whole sequence)."""
        if level >= self.num_levels:
            return 0, len(self.segments)
        size = 2 ** (level - 1)
        first = member // size * size
        return first, min(first + size, len(self.segments))

    def span(self, level: int, member: int) -> tuple[int, int]:
        """The token range [start, end) of `member`'s level-`level` segment."""
        a, b = self.group(level, member)
        return self.segments[a][0], self.segments[b - 1][1]

    def member_of(self) -> Tensor:
        """`[T]` the member whose segment holds each token."""
        return torch.cat([torch.full((e - s,), m, dtype=torch.long) for m, (s, e) in enumerate(self.segments)])


def place_by_proximity(gpu_ids: list[str]) -> list[int]:
    """Members in the order their segments are placed: GPU ids "rack-server-gpu" (numbers) sorted ascending, so
    consecutive segments land on the nearest GPUs (same server, then same rack). Returns indices into `gpu_ids`."""

    def key(i: int) -> tuple[int, ...]:
        parts = gpu_ids[i].split("-")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a GPU id is rack-server-gpu (numbers), got {gpu_ids[i]!r}")
        return tuple(int(p) for p in parts)

    return sorted(range(len(gpu_ids)), key=key)


def key_importance(probs: Tensor, num_kv_heads: int, per_query: bool = True, attended: Tensor | None = None) -> Tensor:
    """`[Hkv, Tk]` from a layer's attention probabilities `[Hq, Tq, Tk]`: the attention each key received from the
    queries of its KV head's query heads (averaged over the group), summed over the queries or (`per_query`) their
    mean over the queries that attended it (`attended` `[Tq, Tk]` bool, the mask; default: a nonzero
    probability)."""
    hq = probs.shape[0]
    assert hq % num_kv_heads == 0, f"{hq} query heads over {num_kv_heads} KV heads"
    received = probs.float().sum(dim=1)  # [Hq, Tk]
    if per_query:
        seen = (probs > 0).sum(dim=1) if attended is None else attended.sum(dim=0)  # [Hq, Tk] or [Tk]
        received = received / seen.clamp(min=1)
    return received.view(num_kv_heads, hq // num_kv_heads, -1).mean(dim=1)


def kept_tokens(levels: CSALevels, importance: Tensor | None, num_kv_heads: int) -> Tensor:
    """`[levels, Hkv, T]` bool: the tokens kept at each level per KV head (the most important `kept_fraction` of
    each segment, rounded to the nearest token; nested across levels). No importance: nothing dropped."""
    t = levels.num_tokens
    kept = torch.ones(levels.num_levels, num_kv_heads, t, dtype=torch.bool)
    if importance is None or levels.drop == 0.0:
        return kept
    assert importance.shape == (num_kv_heads, t), f"importance {tuple(importance.shape)} for {num_kv_heads} x {t}"
    for m, (s, e) in enumerate(levels.segments):
        order = importance[:, s:e].argsort(dim=1, descending=True, stable=True)  # [Hkv, n] most important first
        for lv in range(2, levels.num_levels + 1):
            k = levels.kept_count(lv, m)
            seg = torch.zeros(num_kv_heads, e - s, dtype=torch.bool)
            seg.scatter_(1, order[:, :k], True)
            kept[lv - 1, :, s:e] = seg
    return kept


def level_masks(levels: CSALevels, kept: Tensor, rows: tuple[int, int] | None = None) -> Tensor:
    """`[levels, Hkv, R, K]` bool: may query i attend key j at that level (causal, j in i's level segment outside
    its lower level's segment, both kept at that level), for the queries `rows` = [r0, r1) (default all) and the
    keys [0, r1) they can see."""
    r0, r1 = rows if rows is not None else (0, levels.num_tokens)
    member = levels.member_of()[r0:r1]
    qpos, kpos = torch.arange(r0, r1), torch.arange(r1)
    causal = kpos[None, :] <= qpos[:, None]  # [R, K]
    out = torch.zeros(levels.num_levels, kept.shape[1], r1 - r0, r1, dtype=torch.bool)
    for lv in range(1, levels.num_levels + 1):
        inside = torch.zeros(r1 - r0, r1, dtype=torch.bool)
        for m in member.unique().tolist():
            a, b = levels.span(lv, m)
            cols = (kpos >= a) & (kpos < b)
            if lv > 1:
                la, lb = levels.span(lv - 1, m)
                cols &= (kpos < la) | (kpos >= lb)
            inside[member == m] = cols
        k = kept[lv - 1]  # [Hkv, T]
        out[lv - 1] = inside & causal & k[:, r0:r1, None] & k[:, None, :r1]
    return out


def masked_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, keep_probs: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`, mask `[Hkv, Tq, Tk]` (or `[1, Tq, Tk]`, the same for every head) ->
    out `[Tq, Hq, D]` (0 where a row has no key), lse `[Hq, Tq]` (-inf there) and, with `keep_probs`, the
    probabilities `[Hq, Tq, Tk]`."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    kk = k.float().repeat_interleave(g, dim=1)  # [Tk, Hq, D]
    vv = v.float().repeat_interleave(g, dim=1)
    m = mask.repeat_interleave(g, dim=0) if mask.shape[0] > 1 else mask  # [Hq or 1, Tq, Tk]
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Tq]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out.to(q.dtype), lse, p if keep_probs else None


def csa_attention(
    q: Tensor, k: Tensor, v: Tensor, levels: CSALevels, kept: Tensor, softmax_scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """CSA over one sequence: q `[T, Hq, D]`, k/v `[T, Hkv, D]`, `kept` from `kept_tokens`. Each level attended on
    its own, the levels merged by their log-sum-exps. Returns out `[T, Hq, D]`, lse `[Hq, T]`."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    masks = level_masks(levels, kept)
    outs, lses, _ = zip(*(masked_attention(q, k, v, masks[i], scale) for i in range(levels.num_levels)), strict=True)
    out, lse = merge_attn_states_many(torch.stack(outs).float(), torch.stack(lses))
    return out.to(q.dtype), lse


def dense_oracle(
    q: Tensor, k: Tensor, v: Tensor, levels: CSALevels, kept: Tensor, softmax_scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Dense attention under the union of the levels' masks: what CSA must equal for any drop ratio."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse, _ = masked_attention(q, k, v, level_masks(levels, kept).any(dim=0), scale)
    return out, lse


def dropped_pairs(levels: CSALevels, kept: Tensor) -> tuple[int, int]:
    """(query-key pairs attended, pairs of dense causal attention), per KV head summed: the computation CSA keeps."""
    t = levels.num_tokens
    attended = int(level_masks(levels, kept).any(dim=0).sum())
    return attended, kept.shape[1] * t * (t + 1) // 2


IMPORTANCE = ("own", "all", "all-sum")


class CSAPrompt:
    """An attention context (`attention(layer, q, k, v)`, as the model calls it) for one whole prompt in one forward
    pass with CSA on one process: what the sequence-parallel members would compute together. The first and last of
    the model's layers run dense; every other layer drops by the importance its previous layer measured. Queries go
    `block` rows at a time, so an 8k-token prompt never holds `[H, T, T]`. `attended` / `dense_pairs` count the
    query-key pairs per layer (per KV head, summed).

    `importance` (`key_importance` of which probabilities): `own` (default) the attention a token received from the
    queries of its own segment (level 1, softmax over that segment), per query: what each SP member measures alone,
    with no communication; `all` from every query, per query (softmax over everything a query attends); `all-sum`
    the same summed over the queries."""

    def __init__(
        self, levels: CSALevels, layer_range: tuple[int, int], block: int = 256, importance: str = "own"
    ) -> None:
        if importance not in IMPORTANCE:
            raise ValueError(f"importance is one of {IMPORTANCE}, got {importance!r}")
        self.levels, self.layer_range, self.block, self.scope = levels, layer_range, block, importance
        self.importance: Tensor | None = None  # [Hkv, T] from the layer before
        self.attended: dict[int, int] = {}
        self.dense_pairs: dict[int, int] = {}

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        first, end = self.layer_range
        hkv = k.shape[1]
        dense = layer in (first, end - 1)
        kept = kept_tokens(self.levels, None if dense else self.importance, hkv)
        out, self.importance, attended = _blockwise(q, k, v, self.levels, kept, self.block, self.scope)
        t = self.levels.num_tokens
        self.attended[layer], self.dense_pairs[layer] = attended, hkv * t * (t + 1) // 2
        return out


def _blockwise(
    q: Tensor, k: Tensor, v: Tensor, levels: CSALevels, kept: Tensor, block: int, scope: str
) -> tuple[Tensor, Tensor, int]:
    """Dense attention under the levels' union mask, `block` query rows at a time (equal to `csa_attention`: the
    levels partition each row's keys). Returns out `[T, Hq, D]`, the keys' importance `[Hkv, T]` (`CSAPrompt`'s
    `importance` scope) and the pairs attended."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    received = torch.zeros(hq, t)
    seen = torch.zeros(hkv, t)  # the queries that attended each key (in the importance's scope)
    attended = 0
    for r0 in range(0, t, block):
        r1 = min(t, r0 + block)
        masks = level_masks(levels, kept, (r0, r1))  # [L, Hkv, R, K]
        mask = masks.any(dim=0)
        attended += int(mask.sum())
        kk = k[:r1].float().repeat_interleave(g, dim=1)  # [K, Hq, D]
        vv = v[:r1].float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[r0:r1].float(), kk) * scale  # [Hq, R, K]
        p = torch.softmax(s.masked_fill(~mask.repeat_interleave(g, dim=0), float("-inf")), dim=-1).nan_to_num(0.0)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)
        if scope == "own":
            mask = masks[0]
            p = torch.softmax(s.masked_fill(~mask.repeat_interleave(g, dim=0), float("-inf")), dim=-1)
        seen[:, :r1] += mask.sum(dim=1)
        received[:, :r1] += p.nan_to_num(0.0).sum(dim=1)
    importance = received.view(hkv, g, t).mean(dim=1)  # [Hkv, T]
    return out, importance if scope == "all-sum" else importance / seen.clamp(min=1), attended
