"""The strategies' fast forms (Tetris Eq. 1, LoongServe Eq. 7, the decode step) fitted from the cost model."""

from __future__ import annotations

import pytest

from spindle_costmodel import CostModel, Parallelism, get_hardware, get_model
from spindle_policy.calibration import latency_from_cost_model


def test_fast_forms_follow_the_cost_model_on_any_cluster() -> None:
    cm = CostModel(get_model("llama3-70b"), get_hardware("h100-sxm"))
    prefill, decode = Parallelism(tp=4), Parallelism(tp=8)
    lm = latency_from_cost_model(cm, (1, 2, 4), prefill=prefill, decode=(decode,), transfer_links=4)
    assert lm.prefill is not None and lm.decode is not None and lm.batch_prefill is not None
    assert lm.prefill.sp_sizes() == [1, 2, 4]
    for sp in (1, 2, 4):
        for n, hist in ((8192, 0), (65536, 0), (16384, 32768)):
            exact = cm.prefill(n, hist, Parallelism(tp=4, sp=sp)).total_s
            assert lm.prefill.predict(sp, hist, n) == pytest.approx(exact, rel=0.1)
    assert lm.decode.predict(32, 32 * 4000, tp=8) == pytest.approx(cm.decode(32, 4000, decode).total_s, rel=0.1)
    assert lm.batch_prefill.predict(4, [30000, 20000]) < lm.batch_prefill.predict(1, [30000, 20000])
    assert lm.transfer is not None and lm.transfer.bandwidth_bytes_per_s == 4 * cm.hw.inter.bandwidth
    assert "llama3-70b on h100-sxm" in lm.source


def test_a_model_that_does_not_fit_is_refused() -> None:
    cm = CostModel(get_model("llama3-70b"), get_hardware("a100-40g"))
    with pytest.raises(ValueError, match="no prefill"):
        latency_from_cost_model(cm)
    with pytest.raises(ValueError, match="transfer_links"):
        latency_from_cost_model(CostModel(get_model("llama3-8b"), get_hardware("a100-80g")), transfer_links=0)
