"""Seesaw's choice of prefill and decode configurations from the cost model (`strategies/seesaw/configs.py`)."""

import pytest

from spindle_costmodel import CostModel, get_hardware, get_model
from spindle_costmodel.parallel import Parallelism
from spindle_policy.strategies.seesaw.configs import candidates, choose, label


def test_codellama_34b_on_four_a10s_prefills_as_pp4_and_decodes_as_tp4_as_the_paper_runs_it():
    # Seesaw §6.3 / Fig. 12: CodeLLaMA-34B, arxiv-summarization (prompts ~2,588 tokens), 4 x A10 over PCIe
    choice = choose(CostModel(get_model("codellama-34b"), get_hardware("a10")), 4, 2588, 2588 + 291)
    assert choice.label == "PP4 -> TP4"
    by = {c.label: c for c in choice.table}
    assert list(by) == ["PP4", "TP2PP2", "TP4"]
    assert by["PP4"].prefill_tok_s > by["TP2PP2"].prefill_tok_s > by["TP4"].prefill_tok_s  # TP pays all-reduces
    assert by["TP4"].decode_tok_s > by["TP2PP2"].decode_tok_s > by["PP4"].decode_tok_s  # PP reloads weights


def test_nvlink_narrows_the_gap_tensor_parallel_prefill_loses_less():
    pcie = {c.label: c for c in choose(CostModel(get_model("llama2-70b"), get_hardware("a100-80g-pcie")), 8, 3000,
                                       3300).table}  # fmt: skip
    nvlink = {c.label: c for c in choose(CostModel(get_model("llama2-70b"), get_hardware("a100-80g")), 8, 3000,
                                         3300).table}  # fmt: skip
    assert nvlink["TP8"].prefill_tok_s / nvlink["PP8"].prefill_tok_s > pcie["TP8"].prefill_tok_s / pcie[
        "PP8"].prefill_tok_s  # fmt: skip


def test_candidates_labels_and_a_model_that_does_not_fit():
    assert [label(p) for p in candidates(8, kv_heads=8)] == ["PP8", "TP2PP4", "TP4PP2", "TP8"]
    assert [label(p) for p in candidates(4, kv_heads=2)] == ["PP4", "TP2PP2"]  # no TP beyond the KV heads
    assert label(Parallelism()) == "TP1"
    with pytest.raises(ValueError, match="does not fit on 2 x a10"):
        choose(CostModel(get_model("llama2-70b"), get_hardware("a10")), 2, 2000, 2300)
