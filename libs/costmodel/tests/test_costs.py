"""The cost model's pieces: shapes, devices, parallel costs, memory, chunking, the CLI."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from spindle_costmodel import (
    MODELS,
    Chunk,
    CostModel,
    OutOfMemory,
    Parallelism,
    from_hf_config,
    get_hardware,
    get_model,
    hardware_names,
)
from spindle_costmodel.cli import main as cost_main
from spindle_costmodel.hardware import hardware_from_dict, hardware_to_dict
from spindle_costmodel.parallel import allgather_s, allreduce_s, hierarchical_allgather_s

P = Parallelism
PRESET_MODELS = ("llama2-7b", "llama2-13b", "llama2-70b", "codellama-34b", "llama3-8b", "llama3-70b", "smollm2-135m")
PRESET_HARDWARE = ("a100-40g", "a100-80g", "a100-80g-pcie", "h100-sxm", "h200", "l4", "a10", "cpu")


def test_preset_names_scripts_rely_on() -> None:
    assert set(PRESET_MODELS) <= set(MODELS)
    assert set(PRESET_HARDWARE) <= set(hardware_names())
    for name in PRESET_HARDWARE:
        hw = get_hardware(name)
        assert hardware_from_dict(json.loads(json.dumps(hardware_to_dict(hw)))) == hw
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu-v9")
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-17")


def test_model_sizes_match_the_published_parameter_counts() -> None:
    assert get_model("llama3-8b").params == pytest.approx(8.03e9, rel=0.01)
    assert get_model("llama3-70b").params == pytest.approx(70.6e9, rel=0.01)
    assert get_model("llama2-7b").params == pytest.approx(6.74e9, rel=0.01)
    assert get_model("smollm2-135m").params == pytest.approx(134.5e6, rel=0.01)
    assert get_model("llama3-8b").kv_bytes_per_token == 128 * 1024  # 32 layers x 8 heads x 128 x K,V x bf16
    assert get_model("lwm-1m-text").kv_bytes_per_token == 512 * 1024  # MHA: 4x Llama-3-8B (STRATEGIES.md)


def test_hf_config(tmp_path: Path) -> None:
    cfg = {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = from_hf_config(tmp_path, name="smol")
    assert (shape.head_dim, shape.dtype_bytes, shape.params) == (64, 2, get_model("smollm2-135m").params)
    assert get_model(str(tmp_path / "config.json")).layers == 30
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a Llama-family config"):
        from_hf_config(tmp_path / "bad.json")


def test_parallelism_is_validated_and_mapped_to_links() -> None:
    with pytest.raises(ValueError):
        P(tp=0)
    with pytest.raises(ValueError):
        P(sp_kind="star")
    par = P(tp=8, sp=4)
    assert (par.gpus, par.spans_nodes("tp", 8), par.spans_nodes("sp", 8)) == (32, False, True)
    assert not P(tp=2, sp=4).spans_nodes("sp", 8)
    hw = get_hardware("a100-80g")
    assert allreduce_s(1e6, 1, hw.intra) == 0
    assert allreduce_s(1e6, 8, hw.inter) > allreduce_s(1e6, 8, hw.intra)
    cm = CostModel(get_model("llama3-8b"), hw)
    with pytest.raises(ValueError, match="do not split over TP 3"):
        cm.decode(1, 100, P(tp=3))


def test_prefill_scales_as_eq1_says() -> None:
    """Linear in the chunk for GEMMs, quadratic for attention, C*L for history; SP divides the work."""
    cm = CostModel(get_model("llama3-8b"), get_hardware("h100-sxm"))
    t = {n: cm.prefill(n).total_s for n in (8192, 16384, 131072)}
    assert 2 < t[16384] / t[8192] < 2.6  # mostly linear at 8-16k
    assert t[131072] / t[8192] > 16 * 1.5  # attention dominates at 128k
    hist = cm.prefill(4096, history=65536)
    assert hist.op("attention_prefill").s > 10 * cm.prefill(4096).op("attention_prefill").s  # type: ignore[union-attr]
    assert cm.prefill(131072, par=P(sp=8)).total_s < t[131072] / 6
    ring = cm.prefill(131072, par=P(sp=16))
    assert ring.op("sp_ring").comm_s > 0  # type: ignore[union-attr]
    uly = cm.prefill(131072, par=P(sp=8, sp_kind="ulysses"))
    assert uly.op("sp_alltoall").s > 0  # type: ignore[union-attr]
    assert cm.prefill(100_000, keep=0.5).op("attention_prefill").s < cm.prefill(100_000).op("attention_prefill").s


def test_chunked_prefill_and_the_sequence_pipeline() -> None:
    cm = CostModel(get_model("llama3-8b"), get_hardware("h100-sxm"))
    whole = cm.prefill(65536, par=P(tp=8)).total_s
    chunked = cm.prefill(65536, par=P(tp=8), chunk_size=4096)
    parts = sum(cm.prefill(4096, history=h, par=P(tp=8)).total_s for h in range(0, 65536, 4096))
    assert chunked.total_s == pytest.approx(parts)
    assert chunked.total_s > whole  # per-chunk fixed costs and re-read weights
    spp = cm.prefill(65536, par=P(tp=8, pp=4), chunk_size=4096)
    assert spp.total_s < parts / 2  # chunks overlap across 4 stages
    assert spp.total_s == pytest.approx(sum(o.s for o in spp.ops))
    assert spp.stage_s < spp.total_s  # type: ignore[operator]


def test_decode_tp_kvp_and_mixed_batches() -> None:
    cm = CostModel(get_model("llama3-70b"), get_hardware("h100-sxm"))
    tp4, tp8 = cm.decode(16, 8000, P(tp=4)).total_s, cm.decode(16, 8000, P(tp=8)).total_s
    assert tp8 < tp4
    long1, long2 = cm.decode(1, 2_000_000, P(tp=8)), cm.decode(1, 2_000_000, P(tp=8, kvp=2))
    assert long2.total_s < 0.7 * long1.total_s and long2.op("kvp_exchange").s > 0  # type: ignore[union-attr]
    mixed = cm.step([Chunk(512, 100_000)], [8000] * 32, P(tp=8))
    assert mixed.total_s > cm.decode(32, 8000, P(tp=8)).total_s
    assert mixed.total_s < cm.decode(32, 8000, P(tp=8)).total_s + cm.prefill(512, 100_000, P(tp=8)).total_s
    with pytest.raises(ValueError):
        cm.step([], [])


def test_multi_master_decode_splits_the_dense_work_over_the_masters() -> None:
    """LoongServe §4.2: k masters each run their share of the batch's dense layers, so a large batch steps
    faster than on one master over the same split KV; one instance is plain decode."""
    cm = CostModel(get_model("lwm-1m-text"), get_hardware("a100-80g"))
    assert cm.multi_master_decode(64, 4000, P(tp=2)).total_s == cm.decode(64, 4000, P(tp=2)).total_s
    one, four = cm.decode(1024, 4000, P(tp=2, kvp=4)), cm.multi_master_decode(1024, 4000, P(tp=2, kvp=4))
    assert four.total_s < 0.9 * one.total_s and four.op("kvp_exchange").s > 0  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        cm.multi_master_decode(0, 10)


def test_memory_refuses_plans_that_do_not_fit() -> None:
    cm = CostModel(get_model("llama3-70b"), get_hardware("a100-40g"))
    assert not cm.memory(P(), 0, 1).fits and cm.max_kv_tokens(P()) == 0
    with pytest.raises(OutOfMemory, match="GiB per GPU"):
        cm.memory(P(tp=2), 1_000_000, 1).check()
    tp8 = cm.memory(P(tp=8), 100_000, 1)
    assert tp8.fits and tp8.weights == pytest.approx(get_model("llama3-70b").weight_bytes / 8, rel=0.02)
    assert cm.max_kv_tokens(P(tp=8, pp=2)) > 2 * cm.max_kv_tokens(P(tp=8))
    big = CostModel(get_model("llama3-8b"), get_hardware("h200"))
    assert big.max_kv_tokens(P(tp=8)) > CostModel(get_model("llama3-8b"), get_hardware("h100-sxm")).max_kv_tokens(
        P(tp=8)
    )


def test_transfers() -> None:
    cm = CostModel(get_model("llama3-8b"), get_hardware("a100-80g"))
    one = cm.kv_transfer_s(100_000)
    assert one == pytest.approx(100_000 * 128 * 1024 / 25e9, rel=0.01)
    assert cm.kv_transfer_s(100_000, senders=8) < one / 7
    assert cm.swap_s(100_000) > cm.kv_transfer_s(100_000, spans_nodes=False)
    assert cm.reshard_s(P(tp=4)) == pytest.approx(cm.reshard_s(P(pp=4)))


def test_queries_are_fast() -> None:
    cm = CostModel(get_model("llama3-70b"), get_hardware("h100-sxm"))
    start = time.perf_counter()
    for i in range(2000):
        cm.decode(32, 1000 + i, P(tp=8))
    fresh = (time.perf_counter() - start) / 2000
    start = time.perf_counter()
    for _ in range(2000):
        cm.decode(32, 1000, P(tp=8))
    cached = (time.perf_counter() - start) / 2000
    assert cached < fresh and math.isfinite(fresh)


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["prefill", "--model", "llama3-8b", "--hardware", "a100-80g", "--tokens", "100000", "--sp", "8", "--json"]
    assert cost_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_s"] == pytest.approx(sum(o["s"] for o in out["ops"]))
    assert {"name", "compute_s", "memory_s", "comm_s", "s"} <= set(out["ops"][0]) and "weights" in out["memory_bytes"]
    assert cost_main(["decode", "--model", "llama3-70b", "--hardware", "h100-sxm", "--batch", "4", "--context",
                      "100000", "--tp", "8", "--kvp", "2"]) == 0  # fmt: skip
    assert "kvp_exchange" in capsys.readouterr().out
    assert cost_main(["decode", "--model", "llama3-70b", "--hardware", "a100-40g", "--batch", "1"]) == 3
    assert "does not fit" in capsys.readouterr().err
    assert cost_main(["prefill", "--hardware", "tpu"]) == 2
    assert "unknown hardware" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cost_main(["--help"])
    assert "max(compute, memory)" in capsys.readouterr().out


def test_microbatched_pipeline_pays_its_bubble() -> None:
    cm = CostModel(get_model("llama2-13b"), get_hardware("l4"))
    prompts = [Chunk(1000)] * 16
    one = cm.microbatched(prompts, (), P(pp=4), 1)
    eight = cm.microbatched(prompts, (), P(pp=4), 8)
    assert eight.total_s == pytest.approx((8 + 3) * eight.stage_s)  # type: ignore[operator]
    assert one.total_s == pytest.approx(4 * one.stage_s)  # type: ignore[operator]
    assert eight.total_s < one.total_s  # the stages overlap the micro-batches
    assert eight.total_s == pytest.approx(sum(o.s for o in eight.ops))
    flat = cm.microbatched(prompts, (), P(tp=4), 1)
    assert flat.total_s == pytest.approx(cm.step(prompts, (), P(tp=4)).total_s)
    with pytest.raises(ValueError, match="microbatches"):
        cm.microbatched(prompts, (), P(pp=4), 17)


def test_sp_tp_moves_the_hidden_states_hierarchically() -> None:
    """CSPS SP-TP: an all-gather and a reduce-scatter of the chunk's hidden states per layer, across servers
    first; the attention's pairs per rank are Ulysses' (heads split instead of tokens)."""
    hw = get_hardware("a100-40g-p4d")
    cm = CostModel(get_model("glm-4-9b-1m"), hw)
    n, b = 262_144, 2
    for sp in (4, 8, 16, 32):
        tp = cm.prefill(n, par=P(sp=sp, sp_kind="sp-tp"))
        uly = cm.prefill(n, par=P(sp=sp, sp_kind="ulysses"))
        assert tp.op("attention_prefill").s == pytest.approx(uly.op("attention_prefill").s)  # type: ignore[union-attr]
        local, nodes = min(sp, 8), -(-sp // 8)
        piece = n * 4096 * b / sp
        across = (nodes - 1) * (piece / hw.inter.bandwidth + hw.inter.latency_s)
        within = (local - 1) * (nodes * piece / hw.intra.bandwidth + hw.intra.latency_s)
        want = 2 * (across + within) * cm.model.layers
        assert tp.op("sp_allgather").s == pytest.approx(want)  # type: ignore[union-attr]
    # one node: only NVLink; two nodes: 1/16 of the data per GPU crosses EFA, far less than a flat ring over EFA
    assert hierarchical_allgather_s(1e9, 8, 8, hw.intra, hw.inter) < hierarchical_allgather_s(1e9, 16, 8, hw.intra,
                                                                                             hw.inter)  # fmt: skip
    flat = allgather_s(1e9 / 16, 16, hw.inter)
    assert hierarchical_allgather_s(1e9, 16, 8, hw.intra, hw.inter) < flat / 4
    assert hierarchical_allgather_s(1e9, 1, 8, hw.intra, hw.inter) == 0.0
    assert P(sp=4, sp_kind="sp-tp").label() == "SP4-sp-tp"
    # heads that do not divide: the slowest rank's share (64 ranks over 32 heads: half of them idle)
    for kind in ("sp-tp", "ulysses"):
        att = {sp: cm.prefill(n, par=P(sp=sp, sp_kind=kind)).op("attention_prefill").s for sp in (24, 32, 64)}
        assert att[64] == pytest.approx(att[32])
        assert att[24] == pytest.approx(2 * att[32], rel=0.05)  # 2 heads per rank instead of 1
