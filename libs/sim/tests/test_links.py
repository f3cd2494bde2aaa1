"""Links: a group or a transfer that crosses nodes is priced on the link between nodes, one inside a node on the
node's own link, so where a strategy places a group changes what it costs."""

import pytest

from spindle_costmodel import CostModel, Parallelism, get_hardware, get_model
from spindle_policy import SchedulerConfig
from spindle_policy.calibration import latency_from_cost_model
from spindle_sim import SimConfig, simulate
from spindle_sim.workloads import TraceRequest

COST = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
LATENCY = latency_from_cost_model(COST, sp_sizes=(1, 2, 4), max_tokens=1 << 16)
PROMPT = 4096  # short enough that a ring's KV passing is not hidden behind its attention


@pytest.mark.parametrize("kind", ["ring", "ulysses", "sp-tp"])
def test_the_cost_model_prices_an_sp_group_over_two_nodes_on_the_slower_link(kind):
    inside = Parallelism(sp=4, sp_kind=kind)
    across = Parallelism(sp=4, sp_kind=kind, cross_nodes=True)
    assert not inside.spans_nodes("sp", 8) and across.spans_nodes("sp", 8)
    assert not across.spans_nodes("tp", 8)  # a TP group is one instance's, on one node
    assert COST.prefill(4096, 0, across).total_s > COST.prefill(4096, 0, inside).total_s


def test_the_latency_model_has_both_links():
    assert LATENCY.transfer_intra.bandwidth_bytes_per_s > LATENCY.transfer.bandwidth_bytes_per_s
    assert LATENCY.transfer_on(True) is LATENCY.transfer and LATENCY.transfer_on(False) is LATENCY.transfer_intra
    one_node = LATENCY.prefill_seconds(4, 0, 4096)
    assert LATENCY.prefill_seconds(4, 0, 4096, cross_nodes=True) > one_node
    assert LATENCY.prefill_seconds(1, 0, 32768, cross_nodes=True) == LATENCY.prefill_seconds(1, 0, 32768)


def _run(gpus_per_node: int, strategy: str):
    config = SimConfig(num_prefill=2, num_decode=1, gpus_per_node=gpus_per_node, kv_bytes_per_token=131072,
                       scheduler=SchedulerConfig(max_num_requests=10))  # fmt: skip
    (rec,) = simulate([TraceRequest(0.0, PROMPT, 4)], strategy, LATENCY, config).records
    return rec


def test_a_group_over_two_nodes_is_slower_than_one_on_a_node():
    one_node, two_nodes = _run(8, "fixed-sp:sp=2"), _run(1, "fixed-sp:sp=2")  # 1 GPU a node: each member alone
    assert one_node.max_sp == two_nodes.max_sp == 2
    ttft = [r.prefill_end - r.prefill_start for r in (one_node, two_nodes)]
    assert ttft[1] > ttft[0]
    assert ttft[0] == pytest.approx(LATENCY.prefill_seconds(2, 0, PROMPT))
    assert ttft[1] == pytest.approx(LATENCY.prefill_seconds(2, 0, PROMPT, cross_nodes=True))


def test_a_kv_transfer_between_nodes_is_slower_than_inside_one():
    same, apart = _run(8, "single"), _run(1, "single")
    moved = [r.transfer_end - r.prefill_end for r in (same, apart)]
    assert moved[0] == pytest.approx(LATENCY.transfer_intra.predict(PROMPT * 131072))
    assert moved[1] == pytest.approx(LATENCY.transfer.predict(PROMPT * 131072))
    assert moved[1] > 5 * moved[0]


def test_csa_all_to_all_bytes_are_priced():
    from spindle_costmodel.csa import pair_fraction
    from spindle_sim.prices import CostModelPrices

    prices = CostModelPrices(COST, Parallelism(sp_kind="ulysses"), 1)
    dense = prices.sp_prefill(4, 0, 32768)
    # one level is plain Ulysses: the bytes counted CSA's way cost what the cost model's all-to-all costs
    assert prices.sp_prefill(4, 0, 32768, csa=(1, 0.0, "doubling")) == pytest.approx(dense, rel=0.01)
    keep = pair_fraction(4, 3, 0.1)
    pairs_only = prices.sp_prefill(4, 0, 32768, keep)  # what was priced before: CSA's compute, dense bytes
    with_bytes = prices.sp_prefill(4, 0, 32768, keep, csa=(3, 0.1, "doubling"))
    assert with_bytes < pairs_only < dense
