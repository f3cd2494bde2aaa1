"""Seesaw (issue 25): the re-sharding group model, the strategy's schedules through the core, and the simulator's
re-shards, offloads and onboarding with every invariant; at paper scale, Seesaw against vLLM's static
configurations (`bench/paper_seesaw.py` runs the whole figure)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from spindle_policy import SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.actions import MigrateKV, Reshard, RunBatch
from spindle_policy.latency import LatencyModel, PrefillLatencyModel
from spindle_policy.mixed_batch import MixedFit
from spindle_policy.reshard_model import GroupConfig, ReshardModel, parse_label
from spindle_policy.strategies.seesaw.strategy import SeesawStrategy
from spindle_policy.testing import instance_info, request_spec
from spindle_protocol.messages import IterationDone, KVMigrated, PrefillDone, Resharded, TransferDone
from spindle_sim import Simulator
from spindle_sim.cluster import SimConfig
from spindle_sim.commands import main
from spindle_sim.invariants import check_invariants
from spindle_sim.named_cluster import ClusterSpec, named_cluster
from spindle_sim.workloads import TraceRequest, make_workload


def linear(fixed: float, per_token: float) -> MixedFit:
    """A full pass of n tokens takes fixed + per_token * n (no attention terms)."""
    return MixedFit((1.0, 1e6), (fixed + per_token, fixed + per_token * 1e6), 0.0, 0.0, 0.0)


# PP2 prefills twice as fast per token and pipelines; TP2 decodes a small batch 4x faster than a PP2 full pass
MODEL = ReshardModel(
    {"PP2": GroupConfig("PP2", linear(0.02, 1e-4), 4000), "TP2": GroupConfig("TP2", linear(0.005, 2e-4), 6000)},
    prefill="PP2", decode="TP2", weight_bytes=1e9, host_bytes_per_s=1e10, kv_bytes_per_token=1000,
)  # fmt: skip
LATENCY = LatencyModel(prefill=PrefillLatencyModel({1: (0.01, 1e-4, 0.0, 0.0)}), reshard=MODEL)
CONFIG = SimConfig(
    num_prefill=0, num_decode=0, num_colocated=2, colocated_tp=2, decode_kv_blocks=6000 // 16,
    kv_bytes_per_token=1000, host_kv_blocks=2000, scheduler=SchedulerConfig(max_num_requests=10**4),
)  # fmt: skip
TRACE = [TraceRequest(0.0, 500, 50) for _ in range(40)]


def run(spec: str, config: SimConfig = CONFIG, trace: list[TraceRequest] = TRACE) -> tuple[Simulator, float, dict]:
    sim = Simulator(spec, LATENCY, config)
    result = sim.run(trace)
    check_invariants(sim, result)
    assert all(r.state == "finished" for r in result.records)
    return sim, result.end_time, result.tier


# ---- the group model ----


def test_labels_parse_and_a_switch_moves_the_weights_and_the_kept_kv_twice() -> None:
    assert parse_label("TP2PP4") == (2, 4) and parse_label("PP4") == (1, 4) and parse_label("TP1") == (1, 1)
    for bad in ("", "PP", "DP2", "TP0", "PP2TP2"):
        with pytest.raises(ValueError, match=r"label|>= 1"):
            parse_label(bad)
    assert MODEL.switch_s(0) == pytest.approx(1e-5 + 0.1)
    assert MODEL.switch_s(1000) == pytest.approx(1e-5 + (1e9 + 2 * 1000 * 1000) / 1e10)
    with pytest.raises(ValueError, match="not one of"):
        replace(MODEL, decode="TP4")


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        create_strategy("seesaw:schedule=eager", LATENCY)
    with pytest.raises(ValueError, match="static, or prefill and decode"):
        create_strategy("seesaw:static=TP2,prefill=PP2", LATENCY)
    with pytest.raises(ValueError, match="no configuration 'TP4'"):
        create_strategy("seesaw:decode=TP4", LATENCY)
    live = create_strategy("seesaw", LatencyModel(prefill=LATENCY.prefill))  # the services: the groups say
    assert live.describe() == "seesaw" and type(live).stack_gap(live.options()) == ""
    assert "transition schedule only" in type(live).stack_gap({"schedule": "chunked"})
    assert create_strategy("seesaw", LATENCY).describe() == "seesaw:prefill=PP2,decode=TP2"
    assert create_strategy("seesaw:schedule=chunked,static=TP2", LATENCY).describe() == (
        "seesaw:schedule=chunked,static=TP2"
    )


# ---- the simulator ----


def test_seesaw_prefills_everything_into_the_tier_then_switches_once_and_decodes_it_all() -> None:
    sim, _, tier = run("seesaw")
    assert tier["reshards"] == 2  # one per group, prefill -> decode (the start-up load is not a switch)
    assert tier["swap_out_tokens"] == tier["swap_in_tokens"] == 40 * 500  # every prompt out and back, once
    assert tier["reshard_s"] == pytest.approx(2 * MODEL.switch_s(0), rel=1e-6)  # nothing kept on the GPUs
    assert 0.99 < tier["swap_out_hidden_s"] / tier["swap_out_s"] <= 1.0  # swap-out behind the prefill compute
    assert 0.0 <= tier["swap_in_hidden_s"] <= tier["swap_in_s"]
    assert tier["prefill_busy_s"] > 0 and tier["decode_busy_s"] > 0 and "mixed_busy_s" not in tier  # phases apart
    assert {i.parallel for i in sim.instances.values() if i.role == "elastic"} == {"TP2"}  # type: ignore[attr-defined]
    assert sim.instances["kvstore-0"].peak_blocks == 40 * -(-500 // 16)  # the tier held every prompt at once
    # the prompts finish their prefill before any output token after the first (no interleaving)
    records = sim.records.values()
    assert max(r.prefill_end for r in records) < min(r.token_times[1] for r in records)  # type: ignore[operator]


def test_a_small_tier_switches_back_and_forth_and_parks_the_decodes_it_interrupts() -> None:
    small = replace(CONFIG, host_kv_blocks=4 * -(-550 // 16))  # four sequences
    _, _, tier = run("seesaw", small)
    assert tier["reshards"] > 4
    assert tier["swap_out_tokens"] > 40 * 500  # decodes went back to the tier at a switch to prefill


def test_the_transition_minimising_schedule_beats_every_static_configuration_and_eager_re_sharding() -> None:
    _, seesaw, _ = run("seesaw")
    static = {
        s: run(f"seesaw:schedule={s},static={c}")[1:] for s in ("prefill-first", "chunked") for c in ("PP2", "TP2")
    }
    for spec, (end, tier) in static.items():
        assert not tier.get("reshards"), spec  # static: no switch
        assert seesaw < end, f"seesaw {seesaw:.2f}s vs {spec} {end:.2f}s"
    _, eager, eager_tier = run("seesaw:schedule=prefill-first")  # re-shards whenever a prompt can start (Fig. 2a)
    assert eager_tier["reshards"] > 4 and seesaw < eager


def test_at_paper_scale_seesaw_beats_vllms_best_static_configuration_on_arxiv_summarization() -> None:
    # CodeLLaMA-34B on 8 x A10 as two groups of 4 (the paper's "P4 -> D4" on 4 A10s, Fig. 12), offline arrivals
    setup = named_cluster(ClusterSpec("a10", model="codellama-34b", nodes=1, decode_tp=4), True, True, reshards=True,
                          scheduler=SchedulerConfig(max_num_requests=10**5))  # fmt: skip
    assert (setup.latency.reshard.prefill, setup.latency.reshard.decode) == ("PP4", "TP4")  # type: ignore[union-attr]
    trace = [replace(r, arrived_at=0.0) for r in make_workload("seesaw-arxiv", 100, 1.0, seed=0)]
    ends = {}
    for spec in ("seesaw", *(f"seesaw:schedule={s},static={c}" for s in ("prefill-first", "chunked")
                             for c in ("TP4", "PP4", "TP2PP2"))):  # fmt: skip
        sim = Simulator(spec, setup.latency, setup.config)
        result = sim.run(trace)
        check_invariants(sim, result)
        ends[spec] = result.end_time
    best = min(v for k, v in ends.items() if k != "seesaw")
    assert ends["seesaw"] < best, ends


# ---- through the core: what each event leads to ----


def seesaw_core(tier_blocks: int = 1000) -> SchedulerCore:
    core = SchedulerCore(create_strategy("seesaw", LATENCY), SchedulerConfig())
    group = instance_info("g0", "elastic", 1, total=375, max_model_len=6000)
    core.on_heartbeat(msgspec.structs.replace(group, parallel="PP2"))
    core.on_heartbeat(instance_info("kv", "kvstore", 0, total=tier_blocks))
    return core


def test_through_the_core_prompts_go_to_the_tier_then_one_switch_then_onboarding_and_an_abort_frees_its_place() -> None:
    core = seesaw_core()
    sent = [a for i in range(3) for a in core.admit(request_spec(f"r{i}", 500, 50), 0.0)]
    first = [a for a in sent if isinstance(a, RunBatch)]
    assert len(first) == 1 and first[0].offload == "kv" and first[0].overlap  # PP2: micro-batches pipeline
    assert [p.request_id for p in first[0].prefills] == ["r0"] and first[0].prefills[0].retain[0].instance == "kv"
    strategy = core.strategy
    assert isinstance(strategy, SeesawStrategy)
    acts = core.on_event(IterationDone(instance_id="g0", batch_id=first[0].batch_id, seconds=0.1), 0.1)
    second = [a for a in acts if isinstance(a, RunBatch)]
    assert [p.request_id for p in second[0].prefills] == ["r1", "r2"]  # the rest, in one iteration
    core.on_abort("r1")  # the user goes away while its KV is on its way to the tier
    for rid in ("r0", "r2"):
        core.on_event(PrefillDone(request_id=rid, instance_id="g0", seconds=0.1, finished=False), 0.2)
        core.on_event(TransferDone(request_id=rid, src_instance="g0", dst_instance="kv", nbytes=1, seconds=0.1,
                                   parked=True), 0.2)  # fmt: skip
    acts = core.on_event(IterationDone(instance_id="g0", batch_id=second[0].batch_id, seconds=0.1), 0.3)
    assert acts == [Reshard("g0", "TP2")]  # nothing waits: decode, once every prompt is in the tier
    assert set(strategy.tier_held) == {"r0", "r2"}  # the aborted request holds no place
    acts = core.on_event(Resharded(instance_id="g0", config="TP2", seconds=0.1, weight_bytes=1, kv_bytes=0), 0.4)
    assert [(a.request_id, a.src, a.dst) for a in acts if isinstance(a, MigrateKV)] == [("r0", "kv", "g0"),
                                                                                       ("r2", "kv", "g0")]  # fmt: skip
    acts = core.on_event(KVMigrated(request_id="r0", instance_id="kv", dst="g0", num_tokens=500, seconds=0.1), 0.5)
    decodes = [a for a in acts if isinstance(a, RunBatch)]
    assert [d.request_id for d in decodes[0].decodes] == ["r0"] and not decodes[0].overlap  # TP2: one stage


def test_spindle_sim_reports_the_re_shards_and_the_hidden_swaps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = ["--hardware", "a10", "--model", "codellama-34b", "--nodes", "1", "--decode-tp", "4", "--strategy", "seesaw",
            "--workload", "seesaw-arxiv", "--num-requests", "40", "--rate", "5", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "each a Seesaw group of 4 GPUs (PP4 -> TP4)" in printed and "re-shards 2 (" in printed
    d = json.loads(out.read_text())
    assert d["completed"] == 40 and d["tier"]["reshards"] == 2 and d["tier"]["swap_in_tokens"] > 0
