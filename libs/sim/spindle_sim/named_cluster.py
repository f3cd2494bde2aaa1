"""A named cluster for the simulator: a model on N nodes of a GPU type, its latencies and memory from the cost
model (`spindle_costmodel`), its GPUs shaped into instances the way the strategy runs.

- TP: the smallest power of two (up to a node) whose weight shard leaves >= 30 % of a GPU's memory for KV
  (after the activations of an 8192-token batch), unless given; the decode TP likewise.
- Instances: a disaggregated strategy gets half of the GPUs (`ClusterSpec.prefill_share`, from the strategy's
  `prefill_share`) as prefill instances of the prefill TP and the rest as decode instances of the decode TP; a
  colocated one (`Strategy.colocated`, e.g. `chunked`) gets every GPU as colocated instances of the decode TP.
  Counts given explicitly win; nodes then default to just enough.
- Instances are packed onto nodes in rank order and never straddle two (`cluster.pack_nodes`): a node whose
  size is not a multiple of the TP leaves GPUs idle, and the shape says how many.
- KV capacity per instance: `CostModel.max_kv_tokens` at its TP (the same 8192-token activation reserve for
  prefill instances, whose long chunks need more: an approximation), in blocks of `SimConfig.block_size`.
- Latencies: `latency_from_cost_model` with SP sizes the powers of two up to the prefill instances (at most
  64), prefill at the prefill TP (the colocated TP on a colocated cluster), decode steps and the mixed-batch
  step (chunks and decodes in one iteration) at the decode TP. The
  KV of a TP-t prefill instance leaves over min(t, decode TP, KV heads) GPU links in parallel, so the transfer
  bandwidth is the inter-node link's times that.

Approximate: the prefill model of SP size s is fitted for s consecutive prefill instances (within a node while
s x TP fits one, over the inter-node link beyond), but a strategy may group instances from several nodes; the
simulator prices such a group as if it were packed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from spindle_costmodel import CostModel, OutOfMemory, Parallelism, get_hardware, get_model
from spindle_costmodel.parallel import SP_KINDS
from spindle_policy.calibration import latency_from_cost_model
from spindle_policy.latency import LatencyModel

from .cluster import SimConfig, next_start
from .prices import CostModelPrices

DEFAULT_NODES = 4  # 32 GPUs at 8 per node: Tetris's 32 A100s
KV_ROOM = 0.3  # a default TP leaves at least this share of each GPU's memory for KV
ACTIVATION_TOKENS = 8192  # the batch whose activations an instance keeps room for (max_kv_tokens' default)
MAX_SP = 64
GIB = 2**30


@dataclass(frozen=True)
class ClusterSpec:
    """What the user named; None: derived (see the module docstring)."""

    hardware: str
    model: str = "llama3-8b"
    nodes: int | None = None
    gpus_per_node: int | None = None
    prefill_tp: int | None = None
    decode_tp: int | None = None
    num_prefill: int | None = None
    num_decode: int | None = None
    num_colocated: int | None = None
    spp: int | None = None  # sequence-pipeline stages of each colocated instance (Medha's SPP; default 1)
    sp_kind: str = "ring"  # how SP prefill groups are priced: ring, ulysses (all-to-all) or sp-tp (CSPS's SP-TP)
    prefill_share: float = 0.5  # of the GPUs, for prefill instances on a prefill/decode split (when not counted)
    # the strategies' forms are fitted to samples of the cost model each off by a factor exp(noise x N(0, 1))
    noise: float = 0.0
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.prefill_share < 1:
            raise ValueError(f"prefill_share must be in (0, 1), got {self.prefill_share}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {self.noise}")
        for name in ("nodes", "gpus_per_node", "prefill_tp", "decode_tp", "spp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("num_prefill", "num_decode", "num_colocated"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"instance counts must be >= 0, got {name}={value}")
        if self.sp_kind not in SP_KINDS:
            raise ValueError(f"sp-kind must be one of {', '.join(SP_KINDS)}, got {self.sp_kind!r}")


@dataclass(frozen=True)
class ClusterShape:
    """How a run's GPUs are shaped into instances; `text` says it in one line."""

    model: str | None
    hardware: str | None
    nodes: int
    gpus_per_node: int
    num_prefill: int
    prefill_tp: int
    num_decode: int
    decode_tp: int
    num_colocated: int
    colocated_tp: int
    text: str
    colocated_spp: int = 1

    @property
    def used_gpus(self) -> int:
        return (
            self.num_prefill * self.prefill_tp
            + self.num_decode * self.decode_tp
            + self.num_colocated * self.colocated_tp * self.colocated_spp
        )

    def as_dict(self) -> dict[str, Any]:
        fields = ("model", "hardware", "nodes", "gpus_per_node", "num_prefill", "prefill_tp", "num_decode")
        out = {k: getattr(self, k) for k in (*fields, "decode_tp", "num_colocated", "colocated_tp", "colocated_spp")}
        gpus = self.nodes * self.gpus_per_node
        return out | {"gpus": gpus, "idle_gpus": gpus - self.used_gpus, "shape": self.text}


@dataclass(frozen=True)
class SimSetup:
    """What a run needs: its cluster's shape, the latency model and the simulator's config."""

    shape: ClusterShape
    latency: LatencyModel
    config: SimConfig


def packed_gpus(widths: list[int], gpus_per_node: int) -> int:
    """GPUs up to the end of the last instance, packed in order (idle ones at node ends included)."""
    gpus = 0
    for width in widths:
        gpus = next_start(gpus, width, gpus_per_node) + width
    return gpus


def fill(widths: list[int], width: int, gpus_per_node: int, nodes: int) -> int:
    """How many instances of `width` GPUs fit on `nodes` nodes after `widths`."""
    gpus, count, total = packed_gpus(widths, gpus_per_node), 0, nodes * gpus_per_node
    while (start := next_start(gpus, width, gpus_per_node)) + width <= total:
        gpus, count = start + width, count + 1
    return count


def sp_sizes(num_prefill: int) -> list[int]:
    """Powers of two up to the prefill instances (at most MAX_SP); [1] without prefill instances."""
    sizes = [1]
    while sizes[-1] * 2 <= min(num_prefill, MAX_SP):
        sizes.append(sizes[-1] * 2)
    return sizes


def kv_room(cm: CostModel, tp: int) -> float:
    """Bytes per GPU left for KV at TP `tp` after the weight shard and a batch's activations."""
    plan = cm.memory(Parallelism(tp=tp), 0, ACTIVATION_TOKENS)
    return plan.capacity - plan.weights - plan.activations


def _tp_sizes(cm: CostModel, gpus_per_node: int) -> list[int]:
    """Powers of two up to a node that split the model's heads."""
    sizes, tp = [], 1
    while tp <= gpus_per_node:
        if cm.model.heads % tp == 0:
            sizes.append(tp)
        tp *= 2
    return sizes


def default_tp(cm: CostModel, gpus_per_node: int) -> int:
    """The smallest TP (a power of two, up to a node) leaving >= KV_ROOM of a GPU's memory for KV."""
    sizes = _tp_sizes(cm, gpus_per_node)
    for tp in sizes:
        if kv_room(cm, tp) >= KV_ROOM * cm.hw.mem_bytes:
            return tp
    largest = sizes[-1]
    plan = cm.memory(Parallelism(tp=largest), 0, ACTIVATION_TOKENS)
    raise ValueError(
        f"{cm.model.name} does not fit {cm.hw.name} with {KV_ROOM:.0%} of a GPU left for KV at any TP up to a node "
        f"of {gpus_per_node} GPU(s): at TP{largest} the weights take {plan.weights / GIB:.1f} GiB and activations "
        f"{plan.activations / GIB:.1f} GiB of {plan.capacity / GIB:.1f} GiB usable per GPU "
        f"(give --prefill-tp/--decode-tp, more --gpus-per-node, or a smaller --model)"
    )


def check_split(cm: CostModel, tp: int, role: str, gpus_per_node: int) -> None:
    """An instance of TP `tp` lies on one node and splits the model's heads."""
    where = f"{cm.model.name} on {cm.hw.name} at {role} TP{tp}"
    if tp > gpus_per_node:
        raise ValueError(f"{where}: an instance spans at most one node of {gpus_per_node} GPUs")
    if cm.model.heads % tp:
        raise ValueError(f"{where}: {cm.model.heads} attention heads do not split over {tp} GPUs")


def check_memory(cm: CostModel, tp: int, role: str, block_size: int) -> None:
    """An instance of TP `tp` holds its weight shard, a batch's activations and at least a block of KV."""
    where = f"{cm.model.name} on {cm.hw.name} at {role} TP{tp}"
    try:
        cm.memory(Parallelism(tp=tp), 0, ACTIVATION_TOKENS).check(where)
    except OutOfMemory as e:
        raise ValueError(f"{e} GiB; a larger --{role}-tp splits the weights over more GPUs") from None
    if cm.max_kv_tokens(Parallelism(tp=tp), ACTIVATION_TOKENS) < block_size:
        raise ValueError(f"{where}: the weights and activations leave no room for a block of KV")


def _counts(
    spec: ClusterSpec, colocated: bool, ptp: int, dtp: int, gpn: int, spp: int = 1
) -> tuple[int, int, int, int]:
    """(nodes, prefill, decode, colocated instances of dtp x spp GPUs): the counts given, the others derived."""
    ctp = dtp * spp
    counts: list[int | None]
    if colocated or spec.num_colocated:  # colocated instances; prefill and decode ones only where given
        counts = [spec.num_prefill or 0, spec.num_decode or 0, spec.num_colocated]
    else:
        counts = [spec.num_prefill, spec.num_decode, 0]
    nodes = spec.nodes or (DEFAULT_NODES if None in counts else 0)
    if counts[0] is not None:
        n_p = counts[0]
    else:  # the share of the GPUs to the nearest instance, leaving room for a decode instance (unless counted)
        n_p = max(1, math.floor(nodes * gpn * spec.prefill_share / ptp + 0.5))
        while n_p > 1 and counts[1] is None and fill([ptp] * n_p, dtp, gpn, nodes) < 1:
            n_p -= 1
    n_d = counts[1] if counts[1] is not None else fill([ptp] * n_p, dtp, gpn, nodes)
    n_c = counts[2] if counts[2] is not None else fill([ptp] * n_p + [dtp] * n_d, ctp, gpn, nodes)
    need = -(-packed_gpus([ptp] * n_p + [dtp] * n_d + [ctp] * n_c, gpn) // gpn)
    what = f"{n_p} prefill x TP{ptp} + {n_d} decode x TP{dtp} + {n_c} colocated x {_width(dtp, spp)} instances"
    if nodes and need > nodes:
        raise ValueError(f"{what} need {need} nodes of {gpn} GPUs; the cluster has {nodes}")
    if (n_p < 1 or n_d < 1) and n_c < 1:
        raise ValueError(f"{nodes or need} node(s) of {gpn} GPUs make {what}: need a prefill and a decode instance")
    return nodes or need, n_p, n_d, n_c


def _width(tp: int, spp: int) -> str:
    return f"TP{tp}" if spp == 1 else f"TP{tp}-SPP{spp}"


def _tp_text(cm: CostModel, tps: dict[str, int], given: dict[str, bool], spp: int = 1) -> str:
    """'prefill and decode TP4 (the smallest ...; weights 32.9 GiB/GPU)' for the roles that have instances."""
    groups: dict[tuple[int, bool], list[str]] = {}
    for role, tp in tps.items():
        groups.setdefault((tp, given[role]), []).append(role)
    parts = []
    for (tp, was_given), roles in groups.items():
        pp = spp if "colocated" in roles else 1
        weights = cm.memory(Parallelism(tp=tp, pp=pp)).weights / GIB
        how = "given" if was_given else f"the smallest leaving >= {KV_ROOM:.0%} of a GPU for KV"
        parts.append(f"{' and '.join(roles)} TP{tp} ({how}; weights {weights:.1f} GiB/GPU)")
    return ", ".join(parts)


def _shape(
    spec: ClusterSpec, cm: CostModel, counts: tuple[int, int, int, int], ptp: int, dtp: int, spp: int = 1
) -> ClusterShape:
    nodes, n_p, n_d, n_c = counts
    gpn = cm.hw.gpus_per_node
    roles = [
        (role, n, tp) for role, n, tp in (("prefill", n_p, ptp), ("decode", n_d, dtp), ("colocated", n_c, dtp)) if n
    ]
    explicit = spec.num_prefill is not None or spec.num_decode is not None or spec.num_colocated is not None
    if explicit:
        how = "as given"
    else:
        share = "half" if spec.prefill_share == 0.5 else f"{spec.prefill_share:.0%} of"
        how = "colocated: every GPU prefills and decodes" if n_c else f"{share} the GPUs prefill, the rest decode"
    tps = {role: tp for role, _, tp in roles}
    given = {role: (spec.prefill_tp if role == "prefill" else spec.decode_tp) is not None for role in tps}
    shape = ClusterShape(cm.model.name, cm.hw.name, nodes, gpn, n_p, ptp, n_d, dtp, n_c, dtp, "", spp)
    idle = nodes * gpn - shape.used_gpus
    instances = " + ".join(f"{n} {role} x {_width(tp, spp if role == 'colocated' else 1)}" for role, n, tp in roles)
    text = (
        f"{cm.model.name} on {nodes} x {gpn} {cm.hw.name} ({nodes * gpn} GPUs): {instances} instances "
        f"({how}{f'; {idle} GPUs idle' if idle else ''}); {_tp_text(cm, tps, given, spp)}"
    )
    return replace(shape, text=text)


def _latency(
    cm: CostModel,
    n_p: int,
    ptp: int,
    dtp: int,
    n_elastic: int = 0,
    sp_kind: str = "ring",
    noise: float = 0.0,
    noise_seed: int = 0,
) -> LatencyModel:
    """The strategies' forms fitted to the cost model (from samples with multiplicative `noise`, when given), the
    cost model itself as the run's ground truth (`ground_truth`, sim/prices.py). `n_elastic` > 0: colocated
    instances that form SP groups and multi-master decode groups (elastic), so prefill SP sizes and decode group
    sizes run up to their count. SP groups are priced as `sp_kind`."""
    prefill = Parallelism(tp=ptp if n_p else dtp, sp_kind=sp_kind)  # a colocated instance prefills at its own TP
    links = min(ptp, dtp, cm.model.kv_heads)  # GPUs sending (and receiving) their KV heads' share in parallel
    decode = (Parallelism(tp=dtp),)
    elastic = range(2, min(n_elastic, MAX_SP) + 1)  # every group size: the manager picks any DoP
    groups = tuple(Parallelism(tp=dtp, kvp=k) for k in elastic)
    sizes = sorted({*sp_sizes(n_p), 1, *elastic})
    fitted = latency_from_cost_model(
        cm, sizes, prefill=prefill, decode=decode, transfer_links=links, multi_master=groups, mixed=decode
    )
    truth = CostModelPrices(cm, prefill, links, fitted)  # the run is charged the cost model's own prices
    if noise:  # the strategies plan with forms fitted to a profile whose every sample is off by up to this much
        fitted = latency_from_cost_model(cm, sizes, prefill=prefill, decode=decode, transfer_links=links,
                                         multi_master=groups, mixed=decode, noise=noise, seed=noise_seed)  # fmt: skip
    return replace(fitted, ground_truth=truth)


def named_cluster(
    spec: ClusterSpec,
    colocated: bool,
    elastic: bool = False,
    reshards: bool = False,
    splits_context: bool = False,
    **sim: Any,
) -> SimSetup:
    """The shape, latency model and simulator config of `spec` for a strategy that runs on colocated
    instances (`colocated`; `elastic`: grouped into SP prefill and multi-master decode groups, LoongServe) or on
    a prefill/decode split. `reshards`: each colocated instance is a re-sharding group (Seesaw; `with_reshard`).
    `splits_context`: on a split, the context is what the largest SP group and the decode pool hold together
    (`Strategy.splits_context`), not one instance's. `sim`: further SimConfig fields (decode_step_s, ...)."""
    hw = get_hardware(spec.hardware)
    gpn = spec.gpus_per_node or hw.gpus_per_node
    cm = CostModel(get_model(spec.model), replace(hw, gpus_per_node=gpn))  # links span nodes of this size
    dtp = spec.decode_tp or default_tp(cm, gpn)
    needs_prefill = not (colocated or spec.num_colocated) or bool(spec.num_prefill)
    ptp = spec.prefill_tp or (default_tp(cm, gpn) if needs_prefill else dtp)
    check_split(cm, ptp, "prefill", gpn)
    check_split(cm, dtp, "decode", gpn)
    spp = spec.spp or 1
    counts = _counts(spec, colocated, ptp, dtp, gpn, spp)
    _, n_p, n_d, n_c = counts
    if spp > 1 and (n_p or n_d or not n_c):
        raise ValueError(f"--spp {spp} shapes colocated instances only (Medha's replicas); got {n_p} prefill and "
                         f"{n_d} decode instances")  # fmt: skip
    bs = SimConfig.block_size
    if n_p:
        check_memory(cm, ptp, "prefill", bs)
    if n_d or n_c:
        check_memory(cm, dtp, "decode", bs)
    config = SimConfig(
        num_prefill=n_p,
        num_decode=n_d,
        num_colocated=n_c,
        prefill_tp=ptp,
        decode_tp=dtp,
        colocated_tp=dtp,
        colocated_spp=spp,
        gpus_per_node=gpn,
        block_size=bs,
        prefill_kv_blocks=max(1, cm.max_kv_tokens(Parallelism(tp=ptp), ACTIVATION_TOKENS) // bs),
        decode_kv_blocks=cm.max_kv_tokens(Parallelism(tp=dtp, pp=spp), ACTIVATION_TOKENS) // bs,
        kv_bytes_per_token=cm.model.kv_bytes_per_token,
        query_bytes_per_token=2 * cm.model.layers * cm.model.q_dim * cm.model.dtype_bytes,
        **sim,
    )
    if elastic and not config.max_model_len:  # a request's KV spreads over the pool, so the pool bounds a request
        config = replace(config, max_model_len=n_c * config.decode_kv_blocks * bs)
    if splits_context and n_p and n_d and not config.max_model_len:
        prefill = max(sp_sizes(n_p)) * config.prefill_kv_blocks
        decode = n_d * config.decode_kv_blocks if n_d > 1 else config.decode_kv_blocks  # one KV-parallel group
        config = replace(config, max_model_len=min(prefill, decode) * bs)
    setup = SimSetup(
        _shape(spec, cm, counts, ptp, dtp, spp),
        _latency(cm, n_p, ptp, dtp, n_c if elastic else 0, spec.sp_kind, spec.noise, spec.noise_seed),
        config,
    )
    return with_reshard(setup, cm) if reshards else setup


HOST_KV_SHARE = 0.9  # of each node's host memory, after a copy of the weights, for the host KV tier


def with_reshard(setup: SimSetup, cm: CostModel, prefill_tokens: int = 2048, context: int = 2560) -> SimSetup:
    """Each colocated instance as a Seesaw group of its GPUs: the latency model's `ReshardModel` (every fitting
    PP x TP configuration, c_p and c_d chosen for prompts of `prefill_tokens` decoding at `context`), the KV room of
    the roomiest configuration, and the kvstore's host tier: HOST_KV_SHARE of every node's host memory after a copy
    of the weights (the switches reload from it)."""
    from spindle_policy.strategies.seesaw.configs import reshard_model  # the chooser is Seesaw's

    c = setup.config
    if not c.num_colocated or c.num_prefill or c.num_decode:
        raise ValueError("re-sharding groups are colocated instances; the cluster has a prefill/decode split")
    model, _ = reshard_model(cm, c.colocated_tp, prefill_tokens, context, ACTIVATION_TOKENS)
    kv_tokens = max(g.kv_tokens for g in model.configs.values())
    host = setup.shape.nodes * (cm.hw.host_mem_bytes - cm.model.weight_bytes) * HOST_KV_SHARE
    if host < cm.model.kv_bytes_per_token * c.block_size:
        raise ValueError(f"{cm.hw.name}'s host memory does not hold {cm.model.name}'s weights and a KV tier")
    config = replace(
        c, decode_kv_blocks=kv_tokens // c.block_size,
        host_kv_blocks=int(host // (cm.model.kv_bytes_per_token * c.block_size)),
    )  # fmt: skip
    text = (f"{setup.shape.text}; each a Seesaw group of {c.colocated_tp} GPUs ({model.prefill} -> {model.decode}), "
            f"a host KV tier of {config.host_kv_blocks * c.block_size} tokens")  # fmt: skip
    return SimSetup(replace(setup.shape, text=text), replace(setup.latency, reshard=model), config)


def given_shape(config: SimConfig, how: str = "as given") -> ClusterShape:
    """The shape of a cluster given as instance counts (no named hardware): nodes as the instances pack; `how`
    says where the counts came from."""
    c = config
    widths = c.instance_widths()
    nodes = -(-packed_gpus(widths, c.gpus_per_node) // c.gpus_per_node)
    roles = (("prefill", c.num_prefill, c.prefill_tp), ("decode", c.num_decode, c.decode_tp))
    roles += (("colocated", c.num_colocated, c.colocated_tp),)
    instances = " + ".join(
        f"{n} {role} x {_width(tp, c.colocated_spp if role == 'colocated' else 1)}" for role, n, tp in roles if n
    )
    text = f"{instances} instances ({how}; packed on {nodes} nodes of {c.gpus_per_node} GPUs)"
    counts = (c.num_prefill, c.prefill_tp, c.num_decode, c.decode_tp, c.num_colocated, c.colocated_tp)
    return ClusterShape(None, None, nodes, c.gpus_per_node, *counts, text, c.colocated_spp)


def reshaped(setup: SimSetup, colocated: bool, pipelines: bool = True) -> SimSetup:
    """A cluster given as instance counts, for a strategy that runs colocated (`colocated`) or disaggregated: the
    same GPUs as colocated instances, or half prefill and the rest decode, when the given ones do not suit it.
    Colocated instances given as pipelines (`colocated_spp` > 1) become plain ones for a strategy that cannot use
    them (`pipelines` False: it moves KV between instances)."""
    c = setup.config
    gpus = sum(c.instance_widths())
    if colocated and c.num_colocated and c.colocated_spp > 1 and not pipelines:
        config = replace(c, colocated_spp=1, num_colocated=gpus // c.colocated_tp)
        how = f"the given {gpus} GPUs as colocated instances without pipeline stages"
    elif colocated and not c.num_colocated:
        config = replace(c, num_prefill=0, num_decode=0, num_colocated=gpus // (c.colocated_tp * c.colocated_spp))
        how = f"the given {gpus} GPUs as colocated instances"
    elif not colocated and not (c.num_prefill and c.num_decode):
        n_p = gpus // 2 // c.prefill_tp
        n_d = (gpus - n_p * c.prefill_tp) // c.decode_tp
        config = replace(c, num_prefill=n_p, num_decode=n_d, num_colocated=0, colocated_spp=1)
        how = f"the given {gpus} GPUs split: half prefill, the rest decode"
    else:
        return setup
    return SimSetup(given_shape(config, how), setup.latency, config)
