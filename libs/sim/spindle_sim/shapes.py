"""Who runs on what in a comparison: each strategy's cluster (shaped as it runs on a named cluster, or the given
instances), the spec it runs as, and why one that cannot run is skipped (`spindle sim compare`, its tuning search).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from spindle_policy.strategy import Strategy, create_strategy, parse_strategy_spec, strategy_class, strategy_options

from .cli import _cluster_spec, _latency, _sim_config, _sim_options
from .loadsearch import MaxLoad
from .metrics import SimSummary
from .named_cluster import SimSetup, given_shape, named_cluster, reshaped


@dataclass(frozen=True)
class Entry:
    """One strategy of a comparison: what was asked, what ran, on what, and what came out."""

    asked: str  # the spec as given
    spec: str  # the spec as run (a bare name may get a fitting option)
    setup: SimSetup | None  # None: the cluster could not be shaped for it (see `skipped`)
    note: str = ""  # why `spec` differs from `asked`
    skipped: str = ""  # why it did not run ("" when it did)
    summary: SimSummary | None = None  # the run at --rate
    max_load: MaxLoad | None = None  # the search, with --max-load
    tuned: dict[str, Any] | None = None  # --tune: {"seed", "runs", "chosen": {knob: value}} (tuning.py)


def fit_spec(spec: str, setup: SimSetup) -> tuple[str, str]:
    """(spec to run, why it differs): a bare name whose default `sp` the cluster cannot run gets the largest SP size
    that fits its prefill instances and has a latency fit."""
    name, options = parse_strategy_spec(spec)
    default = strategy_options(name).get("sp")
    prefill, n = setup.latency.prefill, setup.config.num_prefill
    if options or not isinstance(default, int) or prefill is None:
        return spec, ""
    sizes = [s for s in prefill.sp_sizes() if s <= n]
    if default in sizes or not sizes:
        return spec, ""
    if default > n:
        why = f"the default sp={default} needs {default} prefill instances, the cluster has {n}"
    else:
        why = f"the default sp={default} has no latency fit (SP sizes {', '.join(map(str, prefill.sp_sizes()))})"
    return f"{name}:sp={max(sizes)}", why


class Shaper:
    """Each strategy's cluster: on a named cluster the GPUs shaped as it runs (built once per shape), otherwise the
    given instances (reshaped for a strategy they do not suit). `prefill_share` / `decode_tp` override the strategy's
    own share of prefill GPUs and the decode (colocated) TP, for a tuning search (tuning.py)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.named = _cluster_spec(args)
        self.given: SimSetup | None = None
        if self.named is None:
            config = _sim_config(args)
            self.given = SimSetup(given_shape(config), _latency(args), config)
        self.built: dict[tuple[Any, ...], SimSetup | str] = {}

    def setup(
        self, cls: type[Strategy], prefill_share: float | None = None, decode_tp: int | None = None
    ) -> SimSetup | str:
        """The strategy's setup, or why the cluster cannot be shaped for it."""
        share = cls.prefill_share if prefill_share is None else prefill_share
        kind = (cls.colocated, cls.elastic, cls.keeps_kv_in_place, self.args.sp_kind or cls.sp_kind, cls.reshards,
                share, cls.splits_context, decode_tp)  # fmt: skip
        if kind not in self.built:
            try:
                self.built[kind] = self._shape(*kind)
            except ValueError as e:
                self.built[kind] = f"the cluster cannot be shaped for it: {e}"
        return self.built[kind]

    def _shape(
        self,
        colocated: bool,
        elastic: bool,
        pipelines: bool,
        sp_kind: str,
        reshards: bool,
        prefill_share: float,
        splits_context: bool,
        decode_tp: int | None,
    ) -> SimSetup:
        """`pipelines`: the strategy can run on sequence-pipeline replicas (--spp); the others get plain ones.
        `sp_kind`: how its SP groups are priced (--sp-kind, or the strategy's own). `reshards`: re-sharding groups
        (Seesaw). `prefill_share`: its share of the GPUs for prefill instances on a prefill/decode split.
        `splits_context`: the pool's context (`Strategy.splits_context`)."""
        if self.given is not None:
            return reshaped(self.given, colocated, pipelines)
        named = self.named
        assert named is not None
        cluster = replace(named, spp=named.spp if pipelines else None, sp_kind=sp_kind, prefill_share=prefill_share)
        if decode_tp is not None:
            cluster = replace(cluster, decode_tp=decode_tp)
        return named_cluster(cluster, colocated, elastic, reshards, splits_context, **_sim_options(self.args))


def check_runs(spec: str, cls: type[Strategy], setup: SimSetup) -> str:
    """Why `spec` cannot run on `setup` ("" when it can)."""
    try:
        create_strategy(spec, setup.latency)
        if cls.reshards and setup.latency.reshard is None:
            raise ValueError("its re-sharding groups are priced by the cost model: a named cluster (--hardware)")
    except ValueError as e:
        return str(e)
    return ""


def prepare(args: argparse.Namespace, specs: list[str], shaper: Shaper | None = None) -> list[Entry]:
    """Each spec's cluster shape and the spec it runs as; those that cannot run are marked skipped."""
    shaper = shaper or Shaper(args)
    entries: list[Entry] = []
    ran: dict[str, str] = {}  # spec as run -> as asked
    for asked in specs:
        cls = strategy_class(asked)
        setup = shaper.setup(cls)
        if isinstance(setup, str):
            entries.append(Entry(asked, asked, None, skipped=setup))
            continue
        spec, note = fit_spec(asked, setup)
        skipped = f"the same as {ran[spec]}" if spec in ran else check_runs(spec, cls, setup)
        ran.setdefault(spec, asked)
        entries.append(Entry(asked, spec, setup, note, skipped))
    return entries
