"""Typed actions a strategy returns; the executor (NATS shell or simulator) carries them out."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from spindle_costmodel.csa import max_levels, pair_fraction
from spindle_protocol.messages import KVShardSpec, RequestSpec

# How a chunk's tokens are split over an SP group: the names of spindle_engine.sp.SP_LAYOUTS (ring layouts, and
# all-to-all for Ulysses attention), repeated here so the scheduler does not import torch.
LAYOUTS = ("contiguous", "stripe", "zigzag", "all-to-all")


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, end) computed by `instances` as one SP group (size 1: no sequence parallelism)."""

    start: int
    end: int
    instances: tuple[str, ...]
    layout: str = "contiguous"

    def __post_init__(self) -> None:
        assert 0 <= self.start < self.end, f"empty chunk [{self.start}, {self.end})"
        assert self.instances and len(set(self.instances)) == len(self.instances), f"bad group {self.instances}"
        assert self.layout in LAYOUTS, f"unknown layout {self.layout}"

    @property
    def sp(self) -> int:
        return len(self.instances)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def share(self, k: int) -> int:
        """Tokens of the chunk that member `k` of its group computes and holds (the first ones take the rest)."""
        return self.num_tokens // self.sp + (1 if k < self.num_tokens % self.sp else 0)


@dataclass(frozen=True)
class Admit:
    request_id: str
    prefill_instances: tuple[str, ...]  # every instance that computes part of the prompt
    decode_instance: str
    # what the strategy's plan predicts the request's TTFT to be (None: its plan predicts none): the simulator
    # reports how far it was from the TTFT the request got (`SimResult.prediction_error["ttft"]`)
    predicted_ttft_s: float | None = None

    @property
    def prefill_instance(self) -> str:
        """The instance the gateway reports (the first of the plan; "" until a per-iteration strategy places it)."""
        return self.prefill_instances[0] if self.prefill_instances else ""


@dataclass(frozen=True)
class Reject:
    request_id: str
    status: int  # 429 overload, 503 no live workers, 400 bad request
    reason: str
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class KVShard:
    """Prompt tokens [start, end) of a request's KV held by decode `instance` (KV-parallel decode)."""

    instance: str
    start: int
    end: int


@dataclass(frozen=True)
class RunPrefill:
    """Prefill `spec` chunk by chunk, in order; its KV goes to `decode_instance` (or parks in `kvstore_instance`).

    When `decode_instance` also computes the prompt (a colocated / elastic instance) the KV stays where it is
    and the instance mixes the chunks into its decode batches."""

    spec: RequestSpec
    chunks: tuple[PrefillChunk, ...]
    decode_instance: str
    kvstore_instance: str = ""
    # KV-parallel decode: the prompt's KV split over decode instances, in token order; `decode_instance` (the
    # master) holds the first shard, the last one (the tail) also takes every new token. Empty: all on one.
    decode_shards: tuple[KVShard, ...] = ()
    # CSPS's sparse attention (CSA) over a one-chunk all-to-all plan: the drop ratio at level 2 (0: off) and the
    # levels (0: every level); the drop above level 2 ("doubling" or "printed": spindle_costmodel.csa)
    csa_drop: float = 0.0
    csa_levels: int = 0
    csa_rule: str = "doubling"

    def __post_init__(self) -> None:
        assert self.chunks and self.chunks[0].start == 0, "a plan starts at token 0"
        assert all(a.end == b.start for a, b in itertools.pairwise(self.chunks)), "chunks must tile the prompt"
        assert self.chunks[-1].end == self.spec.prompt.num_tokens, "chunks must cover the prompt"
        if s := self.decode_shards:
            assert s[0].instance == self.decode_instance and s[0].start == 0, "the master holds the first shard"
            assert all(a.end == b.start for a, b in itertools.pairwise(s)), "shards must tile the prompt"
            assert s[-1].end == self.spec.prompt.num_tokens and all(x.start < x.end for x in s), "bad shards"
            assert len({x.instance for x in s}) == len(s), "one shard per instance"
        if self.csa_drop or self.csa_levels:
            c = self.chunks
            assert len(c) == 1 and c[0].layout == "all-to-all" and c[0].sp > 1, "CSA runs one all-to-all chunk"
            assert 0.0 <= self.csa_drop < 1.0 and self.csa_levels >= 0, "bad CSA settings"

    @property
    def decode_holders(self) -> tuple[KVShard, ...]:
        """Every decode instance's shard (one shard when the KV is not split)."""
        return self.decode_shards or (KVShard(self.decode_instance, 0, self.spec.prompt.num_tokens),)

    @property
    def prefill_instances(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for c in self.chunks:
            seen.update(dict.fromkeys(c.instances))
        return tuple(seen)

    @property
    def attention_kept(self) -> float:
        """The share of the prompt's attention pairs the plan computes (CSA's sparsity; 1.0 without CSA)."""
        if not self.csa_drop:
            return 1.0
        sp = self.chunks[0].sp
        return pair_fraction(sp, self.csa_levels or max_levels(sp), self.csa_drop, self.csa_rule)

    @property
    def is_single(self) -> bool:
        """One chunk on one instance: what the real prefill service runs before SP prefill (issue 5)."""
        return len(self.chunks) == 1 and self.chunks[0].sp == 1

    @property
    def is_colocated(self) -> bool:
        """Every chunk on the decode instance alone: the prompt is computed where it decodes (an elastic
        instance, whose engine chunks it by its own token budget)."""
        return all(c.instances == (self.decode_instance,) for c in self.chunks)

    @property
    def in_one_engine(self) -> bool:
        """The whole prompt is computed by one instance's engine, which chunks it by itself (no SP plan to send)."""
        return self.is_single or self.is_colocated


def decode_tokens(spec: RequestSpec, holders: tuple[KVShard, ...]) -> dict[str, int]:
    """Tokens each decode instance holds for a request once it decodes: its shard, and on the tail (the last
    holder) every output token too; each of n > 1 choices holds a copy of the prompt's KV (one holder then)."""
    out = {s.instance: (s.end - s.start) * spec.sampling.n for s in holders}
    out[holders[-1].instance] += spec.sampling.max_tokens * spec.sampling.n
    return out


def shard_specs(shards: Iterable[KVShard]) -> list[KVShardSpec]:
    """Shards as the wire carries them (PlaceKVP, KVPShards)."""
    return [KVShardSpec(instance=s.instance, start=s.start, end=s.end) for s in shards]


def whole_prompt(spec: RequestSpec, instances: tuple[str, ...], layout: str = "contiguous") -> tuple[PrefillChunk]:
    return (PrefillChunk(0, spec.prompt.num_tokens, instances, layout),)


def fixed_chunks(spec: RequestSpec, instances: tuple[str, ...], chunk_size: int) -> tuple[PrefillChunk, ...]:
    n = spec.prompt.num_tokens
    return tuple(PrefillChunk(s, min(s + chunk_size, n), instances) for s in range(0, n, chunk_size))


@dataclass(frozen=True)
class FailRequest:
    """End the request with an error everywhere (stream error to the gateway, abort to every instance)."""

    request_id: str
    status: int
    message: str


@dataclass(frozen=True)
class Preempt:
    """Take a decoding request out of `instance`'s batch: its KV (prompt and outputs so far) moves to
    `kvstore_instance` and its blocks free; it resumes on `instance`, FIFO with the requests parked there."""

    request_id: str
    instance: str
    kvstore_instance: str


@dataclass(frozen=True)
class TransferKV:
    """A request parked on decode instance `src` (its KV in the kvstore, waiting for blocks there) waits on
    `dst` instead, which pulls the KV when it has room. (The prefill -> decode transfer is part of RunPrefill,
    and the swap-out to the kvstore part of Preempt.)"""

    request_id: str
    src: str
    dst: str


@dataclass(frozen=True)
class ScaleDownKVP:
    """Decode member `instance` leaves the holders of a decoding KV-parallel request: its shard of the KV moves
    to `into`, the adjacent holder before it (the group's leader carries it out in its next step)."""

    request_id: str
    instance: str
    into: str


@dataclass(frozen=True)
class PrefillPart:
    """Prompt tokens [start, end) of `spec`, computed in one iteration by a group (sequence-parallel over its
    members). `retain`: where that KV stays when the iteration ends, tiling [start, end) over members of the
    group (LoongServe's proactive scale-down: members keep ranges as the ring passes the KV by, so nothing moves
    afterwards); the last holder takes the request's new tokens unless a DecodePart names another master.
    With `master`, the part is instead computed by that member alone, which keeps its KV (retain names it alone),
    attending the request's earlier KV wherever the group's members hold it (Medha's KV parallelism, §3.4)."""

    spec: RequestSpec
    start: int
    end: int
    retain: tuple[KVShard, ...]
    master: str = ""

    def __post_init__(self) -> None:
        assert 0 <= self.start < self.end <= self.spec.prompt.num_tokens, f"bad part [{self.start}, {self.end})"
        r = self.retain
        assert r and r[0].start == self.start and r[-1].end == self.end, f"retain must tile the part: {r}"
        assert all(a.end == b.start for a, b in itertools.pairwise(r)) and all(x.start < x.end for x in r), r
        assert not self.master or (len(r) == 1 and r[0].instance == self.master), f"a master part retains on {r}"

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        """The part ends the prompt: the iteration samples the first token."""
        return self.end == self.spec.prompt.num_tokens


@dataclass(frozen=True)
class DecodePart:
    """One new token of a decoding request; `master` runs its dense layers and stores the token's KV, every
    holder of its KV computes its share of the attention (multi-master distributed decoding)."""

    request_id: str
    master: str


@dataclass(frozen=True)
class RunBatch:
    """One iteration on a group of elastic (colocated) instances: the prefill parts as one SP batch over
    `instances` and the decodes as one multi-master decode batch. Every member is free (its last iteration
    reported done) when it is sent; the group reports `IterationDone(batch_id)` when it ends."""

    batch_id: int
    instances: tuple[str, ...]
    prefills: tuple[PrefillPart, ...] = ()
    decodes: tuple[DecodePart, ...] = ()
    # a pipeline instance may start the next iteration before this one's sampled tokens are back (the strategy
    # keeps every request it samples out of the next spp_size - 1 iterations). The simulator models it; Spindle's
    # pipeline engine waits for every step that samples, so the services ignore it.
    overlap: bool = False
    # every member computes its own chunks (parts with a master) and decodes over the KV the group holds (Medha's KV
    # parallelism), rather than sequence-parallel passes over the group: how the simulator times it
    kvp: bool = False
    # a kvstore whose host tier takes the KV of the prefill parts that retain on it (Seesaw's tiered KV buffer): each
    # such part is a whole prompt, its KV swapped out as it is computed, and its request decodes once a MigrateKV
    # from the kvstore brings the KV back (onboarding)
    offload: str = ""

    def __post_init__(self) -> None:
        members = set(self.instances)
        assert self.instances and len(members) == len(self.instances), f"bad group {self.instances}"
        assert self.prefills or self.decodes, "an iteration runs something"
        assert all(s.instance in members or (s.instance == self.offload and p.start == 0 and p.last)
                   for p in self.prefills for s in p.retain), "KV retained outside the group"  # fmt: skip
        assert all(d.master in members for d in self.decodes), "a master outside the group"
        assert all(p.master in members for p in self.prefills if p.master), "a master outside the group"
        assert not self.kvp or all(p.master for p in self.prefills), "a KV-parallel iteration has no SP passes"
        ids = [p.request_id for p in self.prefills] + [d.request_id for d in self.decodes]
        assert len(set(ids)) == len(ids), "a request twice in one iteration"


@dataclass(frozen=True)
class MigrateKV:
    """Move the KV a decoding request holds on `src` to `dst`; answered by KVMigrated. Neither `src` nor the request
    runs an iteration meanwhile (`dst` may). LoongServe's allocation step frees an instance for a prefill so."""

    request_id: str
    src: str
    dst: str


@dataclass(frozen=True)
class Reshard:
    """Switch colocated instance `instance` to the parallel configuration `to` (a `PPa x TPb` label: `PP4`, `TP4`,
    `TP2PP2`; Seesaw's dynamic re-sharding): its weights load from host memory as `to`, the KV it keeps moves to
    the new layout. It runs no iteration meanwhile (none may be in flight when it is sent); answered by Resharded."""

    instance: str
    to: str


Action = (
    Admit | Reject | RunPrefill | FailRequest | Preempt | TransferKV | ScaleDownKVP | RunBatch | MigrateKV | Reshard
)
