"""One price for the same work: a step's time depends on what it holds, never on which strategy sent it; and
`chunked` batches as vLLM's scheduler does (decodes first, then several prompts' chunks up to a token budget)."""

import pytest

from spindle_costmodel import CostModel, get_hardware, get_model
from spindle_costmodel.costs import SINGLE
from spindle_policy import Admit, SchedulerConfig
from spindle_policy.actions import Action, DecodePart, KVShard, PrefillPart, RunBatch
from spindle_policy.calibration import latency_from_cost_model
from spindle_policy.state import ClusterState
from spindle_policy.strategy import Strategy
from spindle_protocol.messages import IterationDone, RequestSpec, WorkerEvent
from spindle_sim import SimConfig, Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.prices import FittedPrices
from spindle_sim.workloads import TraceRequest

COST = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
LATENCY = latency_from_cost_model(COST, max_tokens=1 << 14, mixed=[SINGLE])
CONFIG = SimConfig(num_prefill=0, num_decode=0, num_colocated=1, kv_bytes_per_token=1024,
                   scheduler=SchedulerConfig(max_num_requests=100))  # fmt: skip
PRICE = FittedPrices(LATENCY, CONFIG.decode_step_s)
LATENCY_FITTED_ONLY = LATENCY  # fitted to the cost model by hand: no ground truth attached


class Replay(Strategy):
    """A per-iteration strategy that sends, one after another, the iterations it is given (steps of
    (prefill parts as (request index, start, end), decoding request indices)) to the one elastic instance."""

    name = "replay"
    colocated = elastic = keeps_kv_in_place = True

    def __init__(self, steps: list[tuple[list[tuple[int, int, int]], list[int]]]) -> None:
        super().__init__(None)
        self.steps, self.specs, self.sent, self.busy = steps, {}, 0, False

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        self.specs[int(spec.request_id.split("-")[1])] = spec
        return [Admit(spec.request_id, (), ""), *self._next()]

    def on_event(self, event: WorkerEvent, state: ClusterState, now: float) -> list[Action]:
        if isinstance(event, IterationDone):
            self.busy = False
        return self._next()

    def _next(self) -> list[Action]:
        if self.busy or self.sent == len(self.steps):
            return []
        parts, decodes = self.steps[self.sent]
        if any(i not in self.specs for i, _, _ in parts):
            return []  # its request has not arrived yet
        self.sent, self.busy = self.sent + 1, True
        iid = "elastic-0"
        prefills = tuple(PrefillPart(self.specs[i], a, b, (KVShard(iid, a, b),)) for i, a, b in parts)
        return [RunBatch(self.sent, (iid,), prefills, tuple(DecodePart(f"req-{i}", iid) for i in decodes))]


def test_a_step_is_priced_by_what_it_holds():
    # decodes alone: the decode step; with chunks: the mixed step, one pass over all of them (not a sum of parts)
    assert PRICE.step(1, [], 4, 4000) == LATENCY.decode.predict(4, 4000, tp=1)
    both = PRICE.step(1, [(0, 512), (0, 300)], 2, 3000)
    assert both == LATENCY.mixed.predict(1, [(0, 512), (0, 300)], 2, 3000)
    assert both < PRICE.step(1, [(0, 512)]) + PRICE.step(1, [(0, 300)]) + PRICE.step(1, [], 2, 3000)
    # and it stays within the cost model it is fitted to
    want = COST.step([], [1000, 2000], SINGLE).total_s
    assert PRICE.step(1, [], 2, 3000) == pytest.approx(want, rel=0.15)


def test_identical_steps_get_identical_times_whichever_strategy_sent_them():
    reqs = [TraceRequest(0.0, 700, 3), TraceRequest(0.0, 300, 3)]
    chunked = Simulator("chunked:chunk_size=512", LATENCY, CONFIG)
    result = chunked.run(reqs)
    check_invariants(chunked, result)
    a, b = result.records
    # what chunked's instance ran: [A 0:512]; [A 512:700, B 0:300] (B joins in what is left of the budget); then
    # two decode steps of A and B
    steps = [([(0, 0, 512)], []), ([(0, 512, 700), (1, 0, 300)], []), ([], [0, 1]), ([], [0, 1])]
    replayed = Simulator(Replay(steps), LATENCY, CONFIG)
    ra, rb = replayed.run(reqs).records
    assert ra.token_times == a.token_times and rb.token_times == b.token_times
    first = PRICE.step(1, [(0, 512)])
    second = PRICE.step(1, [(512, 188), (0, 300)])
    assert a.token_times[0] == pytest.approx(first + second) == b.token_times[0]
    assert a.token_times[1] - a.token_times[0] == pytest.approx(PRICE.step(1, [], 2, 701 + 301))


def test_chunked_packs_several_prompts_into_one_step_up_to_its_budget():
    reqs = [TraceRequest(0.0, 1000, 4)] + [TraceRequest(0.001, 300, 4) for _ in range(3)]
    sim = Simulator("chunked:chunk_size=2048", LATENCY, CONFIG)
    result = sim.run(reqs)
    check_invariants(sim, result)
    first, *short = result.records
    t0 = PRICE.step(1, [(0, 1000)])  # the first prompt arrived alone
    assert first.token_times[0] == pytest.approx(t0)
    # the three short prompts arrived during it and share the next step with the first prompt's first decode
    t1 = t0 + PRICE.step(1, [(0, 300)] * 3, 1, 1001)
    assert [r.token_times[0] for r in short] == pytest.approx([t1] * 3)
    assert first.token_times[1] == pytest.approx(t1)


def test_the_budget_counts_decodes_first_then_prompt_pieces():
    # a budget of 8: a running decode takes one token, the prompt gets the 7 left in each step it shares with it
    reqs = [TraceRequest(0.0, 16, 20), TraceRequest(0.0005, 40, 2)]
    sim = Simulator("chunked:chunk_size=8", LATENCY, CONFIG)
    result = sim.run(reqs)
    check_invariants(sim, result)
    a, b = result.records
    # a: two steps of 8 prompt tokens; b arrives during the first, waits for the budget, then gets 7 per step
    # beside a's decode: 40 tokens take 6 steps (5 x 7 + 5)
    assert a.token_times[0] == pytest.approx(PRICE.step(1, [(0, 8)]) + PRICE.step(1, [(8, 8)]))
    steps_with_b = [t for t in a.token_times[1:] if t <= b.token_times[0] + 1e-12]
    assert len(steps_with_b) == 6


def _named(noise: float = 0.0):
    from spindle_sim.named_cluster import ClusterSpec, named_cluster

    spec = ClusterSpec(hardware="a100-80g", model="llama3-8b", nodes=1, num_prefill=2, num_decode=2, noise=noise)
    return named_cluster(spec, colocated=False, scheduler=SchedulerConfig(max_num_requests=100))


def test_on_a_named_cluster_the_run_is_charged_the_cost_model_and_the_plan_is_judged():
    from spindle_costmodel import Parallelism

    setup = _named()
    reqs = [TraceRequest(0.0, 3000, 8), TraceRequest(30.0, 20000, 4)]
    sim = Simulator("single", setup.latency, setup.config)
    result = sim.run(reqs)
    check_invariants(sim, result)
    short, _ = result.records
    cm, tp = setup.latency.ground_truth.cm, setup.config.prefill_tp
    # the prefill is charged the cost model's own time, not the Eq. 1 fit the strategy plans with
    charged = cm.prefill(3000, 0, Parallelism(tp=tp)).total_s
    assert short.prefill_end - short.prefill_start == pytest.approx(charged)
    assert setup.latency.prefill.predict(1, 0, 3000) != pytest.approx(charged, rel=1e-6)
    errors = result.prediction_error
    assert {"sp_prefill", "decode", "transfer", "all"} <= set(errors)
    assert errors["all"]["n"] == sum(e["n"] for k, e in errors.items() if k not in ("all", "ttft"))
    assert 0 < errors["all"]["mean_abs"] < 0.2  # the fits are close to what they were fitted to
    assert result.summary().prediction_error == errors
    # a profile whose samples are off by ~20 % predicts worse; the charges are the same
    noisy = _named(noise=0.2)
    again = Simulator("single", noisy.latency, noisy.config).run(reqs)
    assert [r.token_times for r in again.records] == [r.token_times for r in result.records]
    assert again.prediction_error["all"]["mean_abs"] > errors["all"]["mean_abs"]


def test_a_plan_s_predicted_ttft_is_judged_against_the_ttft_the_request_got():
    setup = _named()
    reqs = [TraceRequest(0.0, 3000, 4), TraceRequest(0.001, 20000, 4), TraceRequest(60.0, 5000, 4)]
    result = Simulator("request-sp", setup.latency, setup.config).run(reqs)
    ttft = result.prediction_error["ttft"]
    assert ttft["n"] == 3  # every request was planned at arrival with a predicted first token
    got = [r.ttft for r in result.records]
    predicted = [r.predicted_ttft for r in result.records]
    rel = [(p - g) / g for p, g in zip(predicted, got, strict=True)]
    assert ttft["mean_abs"] == pytest.approx(sum(map(abs, rel)) / 3)
    assert ttft["bias"] == pytest.approx(sum(rel) / 3)
    assert 0 < ttft["mean_abs"] < 0.2  # Eq. 1 fitted to the cost model, against the cost model's charge
    # a strategy whose plans predict no TTFT has none to judge
    assert "ttft" not in Simulator("single", setup.latency, setup.config).run(reqs).prediction_error


def test_without_a_cost_model_the_forms_are_the_prices_and_nothing_is_judged():
    result = Simulator("chunked:chunk_size=512", LATENCY_FITTED_ONLY, CONFIG).run([TraceRequest(0.0, 700, 3)])
    assert result.prediction_error == {} and result.summary().prediction_error is None


def test_judged_prices_report_signed_and_absolute_error():
    from spindle_sim.prices import ErrorStats

    e = ErrorStats()
    e.add(charged=1.0, predicted=1.1)
    e.add(charged=2.0, predicted=1.8)
    assert e.as_dict() == pytest.approx({"n": 2, "mean_abs": 0.1, "bias": 0.0, "max_abs": 0.1})
