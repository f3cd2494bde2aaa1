"""`spindle sim` on a named cluster (--model, --hardware, --nodes, ...): the flags, the GPUs shaped into instances
per strategy, the cost model's memory behind the KV capacities and the errors, and every strategy running on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from spindle_costmodel import CostModel, Parallelism, get_hardware, get_model
from spindle_policy.strategy import available_strategies, strategy_class
from spindle_sim.cli import _cluster_spec, build_parser, build_sweep_parser
from spindle_sim.cluster import SimConfig, pack_nodes
from spindle_sim.commands import main
from spindle_sim.executor import Simulator
from spindle_sim.named_cluster import ClusterSpec, default_tp, named_cluster, sp_sizes

CLUSTERS = {
    "70b-h100x16": ["--model", "llama3-70b", "--hardware", "h100-sxm", "--nodes", "2"],
    "8b-a100x32": ["--model", "llama3-8b", "--hardware", "a100-80g", "--nodes", "4"],
}
SMALL = ["--workload", "tetris-short", "--num-requests", "60", "--rate", "1", "--seed", "1"]


def test_the_flags_parse_into_a_cluster_spec() -> None:
    argv = ["--model", "llama3-70b", "--hardware", "h100-sxm", "--nodes", "3", "--gpus-per-node", "4"]
    for parser, extra in ((build_parser(), []), (build_sweep_parser(), ["--strategies", "single"])):
        args = parser.parse_args([*argv, "--prefill-tp", "2", "--decode-tp", "4", "--instances", "2", *extra])
        assert _cluster_spec(args) == ClusterSpec(
            hardware="h100-sxm", model="llama3-70b", nodes=3, gpus_per_node=4, prefill_tp=2, decode_tp=4, num_prefill=2
        )
    assert _cluster_spec(build_parser().parse_args(["--hardware", "a100-80g"])) == ClusterSpec("a100-80g")
    assert _cluster_spec(build_parser().parse_args([])) is None  # today's default: the paper calibration
    with pytest.raises(SystemExit):  # --hardware excludes the other latency sources
        build_parser().parse_args(["--hardware", "h100-sxm", "--calibration", "tetris-a100-llama3-8b"])


@pytest.mark.parametrize(
    ("spec", "colocated", "expected"),
    [  # (nodes, prefill x TP, decode x TP, colocated x TP, idle GPUs)
        (ClusterSpec("h100-sxm", "llama3-70b", nodes=2), False, (2, (2, 4), (2, 4), (0, 4), 0)),
        (ClusterSpec("a100-80g", "llama3-8b", nodes=4), False, (4, (16, 1), (16, 1), (0, 1), 0)),
        (ClusterSpec("a100-80g", "llama3-8b", nodes=4), True, (4, (0, 1), (0, 1), (32, 1), 0)),
        (ClusterSpec("a100-40g", "llama3-70b"), False, (4, (2, 8), (2, 8), (0, 8), 0)),  # default 4 nodes, TP8
        (ClusterSpec("h100-sxm", "llama3-70b", nodes=2, gpus_per_node=6), False, (2, (1, 4), (1, 4), (0, 4), 4)),
        (ClusterSpec("a100-80g", num_prefill=8, num_decode=2, decode_tp=8), False, (3, (8, 1), (2, 8), (0, 8), 0)),
        (ClusterSpec("a100-80g", nodes=2, num_prefill=4), False, (2, (4, 1), (12, 1), (0, 1), 0)),
        (ClusterSpec("a100-80g", prefill_tp=2, decode_tp=4, nodes=3), False, (3, (6, 2), (3, 4), (0, 4), 0)),
        # spindle's 4/5: 12.8 prefill instances round to 13 (not down to 12)
        (ClusterSpec("h100-sxm", "llama3-70b", nodes=8, prefill_share=0.8), False, (8, (13, 4), (3, 4), (0, 4), 0)),
        (ClusterSpec("a100-80g", "llama3-8b", nodes=4, prefill_share=0.8), False, (4, (26, 1), (6, 1), (0, 1), 0)),
    ],
)
def test_instances_derived_from_the_cluster(spec: ClusterSpec, colocated: bool, expected: tuple) -> None:
    setup = named_cluster(spec, colocated)
    s, c = setup.shape, setup.config
    got = (s.nodes, (s.num_prefill, s.prefill_tp), (s.num_decode, s.decode_tp), (s.num_colocated, s.colocated_tp))
    assert (*got, s.as_dict()["idle_gpus"]) == expected
    assert (c.num_prefill, c.num_decode, c.num_colocated) == (s.num_prefill, s.num_decode, s.num_colocated)
    assert (c.prefill_tp, c.decode_tp, c.colocated_tp) == (s.prefill_tp, s.decode_tp, s.colocated_tp)
    assert c.gpus_per_node == s.gpus_per_node and s.text.startswith(f"{spec.model} on {s.nodes} x")
    # memory, KV size and the decode shape the executor asks for come from the cost model
    hw = get_hardware(spec.hardware)
    cm = CostModel(get_model(spec.model), hw)
    assert c.kv_bytes_per_token == cm.model.kv_bytes_per_token
    assert c.decode_kv_blocks == cm.max_kv_tokens(Parallelism(tp=s.decode_tp)) // c.block_size
    if s.num_prefill:
        assert c.prefill_kv_blocks == cm.max_kv_tokens(Parallelism(tp=s.prefill_tp)) // c.block_size
    assert setup.latency.decode is not None and (s.decode_tp, 1) in setup.latency.decode.coeffs
    assert setup.latency.prefill is not None and setup.latency.prefill.sp_sizes() == sp_sizes(s.num_prefill)


def test_sequence_pipeline_replicas_take_tp_x_spp_gpus_and_hold_kv_on_all_of_them() -> None:
    setup = named_cluster(ClusterSpec("h100-sxm", "llama3-70b", nodes=8, decode_tp=8, spp=4), True)
    s, c = setup.shape, setup.config
    assert (s.num_colocated, s.colocated_tp, s.colocated_spp, s.as_dict()["idle_gpus"]) == (2, 8, 4, 0)
    assert c.colocated_spp == 4 and c.instance_widths() == [32, 32]
    assert "2 colocated x TP8-SPP4 instances" in s.text
    cm = CostModel(get_model("llama3-70b"), get_hardware("h100-sxm"))
    assert c.decode_kv_blocks == cm.max_kv_tokens(Parallelism(tp=8, pp=4)) // c.block_size
    assert c.decode_kv_blocks > 4 * cm.max_kv_tokens(Parallelism(tp=8)) // c.block_size  # the weights split too
    with pytest.raises(ValueError, match="colocated instances only"):
        named_cluster(ClusterSpec("h100-sxm", "llama3-70b", nodes=8, decode_tp=8, spp=4), False)
    with pytest.raises(ValueError, match="spp must be >= 1"):
        ClusterSpec("h100-sxm", spp=0)


def test_default_tp_leaves_room_for_kv() -> None:
    tp = {m: default_tp(CostModel(get_model(m), get_hardware("h100-sxm")), 8) for m in ("llama3-8b", "llama3-70b")}
    assert tp == {"llama3-8b": 1, "llama3-70b": 4}  # 70B at TP2: 66 of 80 GB are weights
    assert sp_sizes(0) == [1] and sp_sizes(16) == [1, 2, 4, 8, 16] and sp_sizes(100) == [1, 2, 4, 8, 16, 32, 64]


def test_instances_pack_onto_nodes_by_their_tp() -> None:
    assert pack_nodes([4, 4, 4, 4], 8) == [0, 0, 1, 1]
    assert pack_nodes([1] * 6 + [4, 4], 8) == [0] * 6 + [1, 1]  # 2 GPUs of node 0 idle: a TP4 never straddles
    assert pack_nodes([16, 1], 8) == [0, 2]  # wider than a node: whole nodes of its own
    config = SimConfig(num_prefill=3, num_decode=2, prefill_tp=2, decode_tp=4, with_kvstore=False)
    setup = named_cluster(ClusterSpec("h100-sxm", nodes=2, decode_tp=4), False)
    sim = Simulator("single", setup.latency, config)
    nodes = {i.id: (i.node, i.info(0.0).tp_size) for i in sim.instances.values()}
    assert nodes == {
        "prefill-0": ("node-0", 2), "prefill-1": ("node-0", 2), "prefill-2": ("node-0", 2),
        "decode-0": ("node-1", 4), "decode-1": ("node-1", 4),
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"\(tp, kvp\) = \(4, 1\)"):  # no decode coefficients for TP4 at TP1
        Simulator("single", named_cluster(ClusterSpec("h100-sxm", decode_tp=1), False).latency, config)


def test_a_model_that_does_not_fit_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-70b", "--hardware", "a100-40g", "--prefill-tp", "1", "--num-requests", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "llama3-70b on a100-40g at prefill TP1" in err
    assert "weights 131.4" in err and "33.5 GiB" in err and "--prefill-tp" in err
    for bad, says in (
        (["--hardware", "a100-80g", "--nodes", "1", "--prefill-tp", "8", "--decode-tp", "8"], "need a prefill"),
        (["--hardware", "a100-80g", "--nodes", "1", "--instances", "9"], "need 2 nodes"),
        (["--hardware", "a100-80g", "--prefill-tp", "16"], "at most one node"),
        (["--hardware", "a100-80g", "--model", "nope"], "unknown model"),
        (["--nodes", "2"], "give --hardware"),
    ):
        assert main([*bad, "--num-requests", "5"]) == 2
        assert says in capsys.readouterr().err


def _spec(name: str, num_prefill: int) -> str:
    """A strategy with the options it needs on a cluster of `num_prefill` prefill instances."""
    return f"fixed-sp:sp={min(8, num_prefill)}" if name == "fixed-sp" else name


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("name", available_strategies())
def test_every_strategy_runs_on_a_named_cluster(name: str, cluster: str, tmp_path: Path) -> None:
    argv, out = CLUSTERS[cluster], tmp_path / "sim.json"
    shape = named_cluster(_cluster_spec(build_parser().parse_args(argv)), False).shape  # type: ignore[arg-type]
    assert main([*argv, *SMALL, "--strategy", _spec(name, shape.num_prefill), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["completed"] == d["num_requests"] == 60, d["strategy"]
    c = d["cluster"]
    assert c["model"] == argv[1] and c["hardware"] == argv[3] and c["nodes"] == int(argv[5]) and c["gpus_per_node"] == 8
    if strategy_class(name).colocated:  # colocated (chunked, loongserve): every GPU
        assert c["num_prefill"] == c["num_decode"] == 0 and c["num_colocated"] * c["colocated_tp"] == c["gpus"]
    else:  # disaggregated: the strategy's share prefills (half, spindle 4/5), the rest decodes
        share = strategy_class(name).prefill_share
        prefill, decode = c["num_prefill"] * c["prefill_tp"], c["num_decode"] * c["decode_tp"]
        nearest = math.floor(c["gpus"] * share / c["prefill_tp"] + 0.5)
        assert prefill + decode == c["gpus"] and prefill == nearest * c["prefill_tp"]


def test_sweep_shapes_each_strategy_and_writes_the_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    argv = ["sweep", *CLUSTERS["70b-h100x16"], "--strategies", "single,chunked", "--rates", "1"]
    assert main([*argv, "--num-requests", "30", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 prefill x TP4 + 2 decode x TP4 instances" in printed and "4 colocated x TP4 instances" in printed
    d = json.loads(out.read_text())
    assert all(r["completed"] == 30 for r in d["rows"])
    by = d["cluster"]["by_strategy"]
    assert d["cluster"]["num_prefill"] == by["single"]["num_prefill"] == 2 and by["chunked"]["num_colocated"] == 4


def test_the_profile_path_still_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spindle_policy.profile_data import fit_profile, profile_document, write_profile

    prefill = [[sp, h, n, 1e-3 * sp**-0.5 + 2e-5 * n / sp + 1e-9 * h * n + 3e-9 * n * n / sp]
               for sp in (1, 2) for h in (0, 1024, 4096) for n in (256, 1024, 4096)]  # fmt: skip
    decode = [[1, 1, b, b * kv, 2e-3 + 1e-4 * b + 1e-7 * b * kv] for b in (1, 4, 8) for kv in (256, 1024, 2048)]
    transfer = [[n, 1e-4 + n / 1e9] for n in (2**16, 2**20, 2**24)]
    fit = fit_profile(prefill, decode, transfer, source="a quick test profile")
    doc = profile_document(
        machine={}, config={}, prefill_rows=prefill, decode_rows=decode, transfer_rows=transfer, fit=fit, wall_s=0.1
    )
    profile, out = tmp_path / "profile.json", tmp_path / "sim.json"
    write_profile(doc, profile)
    argv = ["--profile", str(profile), "--instances", "4", "--decode-instances", "2", "--strategy", "request-sp"]
    assert main([*argv, *SMALL, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 60 and d["strategy"].startswith("request-sp")
    assert d["cluster"]["model"] is None and d["cluster"]["num_prefill"] == 4 and d["cluster"]["nodes"] == 1
    assert "cluster: 4 prefill x TP1 + 2 decode x TP1 instances (as given" in capsys.readouterr().out


CPU_PROFILE = Path(__file__).parents[3] / "bench" / "results" / "cpu_profile.json"


@pytest.mark.parametrize("name", available_strategies())
def test_every_strategy_runs_on_this_machines_fitted_device(name: str, tmp_path: Path) -> None:
    """`--hardware` takes a `spindle profile` JSON: the cost model on this CPU's fitted efficiencies."""
    argv = ["--model", "smollm2-135m", "--hardware", str(CPU_PROFILE), "--nodes", "4", "--gpus-per-node", "1"]
    small = ["--workload", "loongserve-sharegpt", "--num-requests", "30", "--rate", "0.05", "--seed", "1"]
    out = tmp_path / "sim.json"
    assert main([*argv, *small, "--strategy", _spec(name, 2), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["completed"] == d["num_requests"] == 30, d["strategy"]
    assert d["cluster"]["hardware"] == "cpu" and d["cluster"]["gpus"] == 4  # the fitted device keeps its name


def test_compare_gives_pipeline_replicas_only_to_strategies_that_can_run_on_them() -> None:
    from spindle_sim.compare import build_compare_parser
    from spindle_sim.shapes import prepare

    args = build_compare_parser().parse_args(
        ["--hardware", "a100-80g", "--nodes", "2", "--decode-tp", "8", "--spp", "2", "--num-requests", "10"]
    )
    entries = {e.asked: e for e in prepare(args, ["medha", "loongserve", "single"])}
    assert (entries["medha"].setup.shape.num_colocated, entries["medha"].setup.shape.colocated_spp) == (1, 2)
    assert (entries["loongserve"].setup.shape.num_colocated, entries["loongserve"].setup.shape.colocated_spp) == (2, 1)
    assert entries["single"].setup.shape.num_prefill > 0 and not entries["single"].skipped
    from spindle_sim.cli import build_parser, setups

    single = build_parser().parse_args(["--hardware", "a100-80g", "--spp", "2", "--strategy", "single"])
    with pytest.raises(ValueError, match="--spp shapes pipeline replicas"):
        setups(single, ["single"])


def test_a_named_cluster_prices_each_strategys_sp_groups_as_it_runs_them() -> None:
    """csps runs all-to-all (Ulysses) groups, request-sp ring ones: the simulator fits each its own prefill model,
    unless --sp-kind says; SP-TP prices its all-gathers."""
    from spindle_sim.cli import setups

    base = ["--hardware", "a100-80g", "--model", "llama3-8b", "--nodes", "2"]
    built = setups(build_parser().parse_args(base), ["csps", "request-sp"])
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    n = 131_072
    for spec, kind in (("csps", "ulysses"), ("request-sp", "ring")):
        want = cm.prefill(n, par=Parallelism(sp=8, sp_kind=kind)).total_s
        assert built[spec].latency.prefill.predict(8, 0, n) == pytest.approx(want, rel=0.1), spec
    forced = setups(build_parser().parse_args([*base, "--sp-kind", "sp-tp"]), ["csps", "request-sp"])
    assert forced["csps"] is forced["request-sp"]  # one shape, priced as SP-TP for both
    want = cm.prefill(n, par=Parallelism(sp=8, sp_kind="sp-tp")).total_s
    assert forced["csps"].latency.prefill.predict(8, 0, n) == pytest.approx(want, rel=0.1)
    with pytest.raises(ValueError, match="sp-kind"):
        ClusterSpec("a100-80g", sp_kind="star")


def test_a_strategy_that_splits_the_context_serves_the_pools():
    spec = ClusterSpec("a100-80g", "llama3-8b", nodes=2, prefill_share=0.8)  # 13 prefill + 3 decode, TP1
    plain, split = named_cluster(spec, False).config, named_cluster(spec, False, splits_context=True).config
    assert plain.context_len() == plain.capacity_tokens()  # one instance's
    bs = split.block_size
    assert split.context_len() == min(8 * split.prefill_kv_blocks, 3 * split.decode_kv_blocks) * bs  # SP 8, KVP 3
    assert split.context_len() > 2 * plain.context_len()
    assert strategy_class("spindle").splits_context and not strategy_class("tetris").splits_context
