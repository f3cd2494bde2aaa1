"""Seesaw's re-sharding (`spindle_engine.reshard`): parallel configurations, the shared host weights and KV tier,
and `spindle verify --reshard` end to end on real processes over gloo against the single engine.

The fast cases run a tiny random-weight Llama with 4 KV heads and 5 layers (uneven pipeline splits, TP over 3
ranks of 4 heads); the slow one runs SmolLM2 (TP 2 over its 3 KV heads) through the CLI."""

import json
import random
from pathlib import Path

import pytest
import torch

from spindle_engine.reshard import HostKV, HostWeights, Parallel, ReshardPlan
from spindle_engine.reshard.verify import verify_reshard
from spindle_engine.sp.verify import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=311, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, rope_theta=1e4,
                         tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.25)  # sharp logits, varied greedy tokens  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama-4kv")
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


def test_configurations_parse_and_bad_ones_say_why():
    assert Parallel.parse("PP2xTP2") == Parallel.parse("tp2pp2") == Parallel(2, 2)
    assert Parallel.parse("TP4").label() == "TP4" and Parallel(3, 1).layers(2, 5) == (4, 5)
    plan = ReshardPlan.parse("PP2:TP2")
    assert plan.world == 2 and plan.label() == "PP2:TP2" and Parallel(2, 2).position(3) == (1, 1)
    for text, message in [
        ("PP2:TP4", "same number of processes"),
        ("TP2:PP2", "decode runs tensor-parallel"),
        ("PP2", "PREFILL:DECODE"),
        ("PQ2:TP2", "like PP2"),
        ("PP2PP2:TP4", "given twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            ReshardPlan.parse(text)
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        ReshardPlan.parse("PP2x TP2:TP4".replace(" ", "")).check(num_layers=30, num_kv_heads=3)
    with pytest.raises(ValueError, match="pipeline stages for 2 layers"):
        ReshardPlan.parse("PP3:TP3").check(num_layers=2, num_kv_heads=8)


def test_host_weights_and_kv_tier_hold_what_was_put_and_count_bytes(tmp_path):
    state = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2, 3).half()}
    host = HostWeights.publish(state, tmp_path / "w")
    again = HostWeights(tmp_path / "w")  # another process maps the same pages
    assert set(again) == set(state) and all(torch.equal(again[k], v) for k, v in state.items())
    assert host.nbytes >= sum(t.numel() * t.element_size() for t in state.values())

    kv = HostKV(tmp_path / "kv", layers=2, kv_heads=4, tokens=6, head_dim=3, dtype=torch.float32, create=True)
    k, v = torch.randn(6, 2, 3), torch.randn(6, 2, 3)  # [tokens, heads, D]: heads 1-2 of layer 1
    kv.push(1, (1, 3), 0, k, v)
    reader = HostKV(tmp_path / "kv", 2, 4, 6, 3, torch.float32, create=False)
    ko, vo = torch.zeros(2, 8, 3), torch.zeros(2, 8, 3)  # [heads, capacity, D]
    reader.pull(1, (1, 3), 6, ko, vo)
    assert torch.equal(ko[:, :6], k.transpose(0, 1)) and torch.equal(vo[:, :6], v.transpose(0, 1))
    assert kv.pushed == reader.pulled == 2 * k.numel() * 4
    assert HostKV.nbytes(2, 4, 6, 3, torch.float32) == 2 * 2 * 4 * 6 * 3 * 4


@pytest.mark.parametrize("plan", ["PP2xTP2:TP4", "PP3:TP3"])
def test_tiny_model_resharded_between_prefill_and_decode_equals_the_single_engine(tiny_dir, plan):
    ids = [random.Random(1).randrange(311) for _ in range(97)]
    result = verify_reshard(ReshardPlan.parse(plan), ids, model=tiny_dir, max_new_tokens=6, rounds=2, timeout_s=240)
    print(f"\n{result.summary()}")
    assert result.match, result.summary()
    assert result.kv_pushed == result.kv_pulled == 2 * result.kv_bytes_theory  # the whole KV once each way, a round
    assert len(result.switch_to_decode_s) == 2 and len(result.switch_to_prefill_s) == 1
    assert all(b >= result.weight_bytes_host * 0.9 for b in result.switch_to_decode_bytes)  # every rank its shard


@pytest.mark.slow
def test_smollm2_pp2_to_tp2_through_the_cli(tmp_path, capsys):
    from spindle_model import Tokenizer, resolve_model

    prompt = tmp_path / "p.json"  # the first 433 tokens of the example document (the README reports all of it)
    ids = Tokenizer(resolve_model("smollm2").path).encode(Path("examples/doc.txt").read_text())[:433]
    prompt.write_text(json.dumps(ids))
    out = tmp_path / "r.json"
    code = main(["--prompt-file", str(prompt), "--reshard", "PP2:TP2", "--max-new-tokens", "6", "--rounds", "1",
                 "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["match"] and doc["kv_pushed"] == doc["kv_pulled"] == doc["kv_bytes_theory"]
    assert main(["--prompt-file", "examples/doc.txt", "--reshard", "PP2:TP4"]) == 2  # 4 processes vs 2


def _greedy(model_dir: str, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    from spindle_engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=model_dir, kv_cache_tokens=512, block_size=4, max_model_len=256))
    out: dict[str, list[int]] = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("plan", ["PP2:TP2", "PP3:TP3", "PP2xTP2:TP4"])
def test_group_prefills_into_the_tier_switches_both_ways_and_decodes_like_the_single_engine(tiny_dir, plan, tmp_path):
    """The stack's re-sharding group (`reshard.group`): prompts through the pipeline into the host tier, a switch to
    TP, onboarding (with and without the prefetcher), a decode parked back into the tier, a switch back to the
    pipeline for a new prompt, and again; every request's tokens equal the single engine's; one request aborted
    after its prefetch; the tier and the blocks end empty."""
    from spindle_engine.reshard.testing import group_worker
    from spindle_model.testing import run_gloo

    rng = random.Random(3)
    sizes = [("a", 13), ("b", 7), ("c", 21), ("d", 10), ("e", 5)]  # e: aborted after its prefetch
    prompts = {rid: [rng.randrange(3, 311) for _ in range(n)] for rid, n in sizes}
    pp, tp = plan.split(":")
    steps = [["prefill", ["a", "b", "e"]], ["prefill", ["c"]], ["switch", tp], ["onboard", "a"], ["onboard", "b"],
             ["prefetch", "c"], ["prefetch", "e"], ["decode", 1], ["abort", "e"], ["onboard", "c"], ["decode", 2],
             ["refused", pp], ["park", "b"], ["decode", 1], ["park", "a"], ["park", "c"], ["switch", pp],
             ["prefill", ["d"]], ["switch", tp], ["onboard", "b"], ["onboard", "d"], ["onboard", "a"],
             ["onboard", "c"], ["decode", 12]]  # fmt: skip
    script = {"prompts": prompts, "steps": steps, "max_tokens": 9, "tier_tokens": 200}
    world = ReshardPlan.parse(plan).world
    results = run_gloo(group_worker, world, tmp_path, tiny_dir, plan, json.dumps(script), str(tmp_path))
    r = results[0]
    want = _greedy(tiny_dir, prompts, 9)
    got = {rid: r[f"tokens:{rid}"].tolist() for rid in prompts}
    assert got.pop("e") == want.pop("e")[:1]  # its first token, then aborted in the tier
    assert got == want
    assert r["prefetch_s"][0] > 0  # the prefetcher read (c, e) off the engine thread
    assert len(r["switch_s"]) == 4  # the first load, to TP, back to the pipeline, to TP
    assert r["tier"][2:].tolist() == [0, 0] and r["tier"][0] > r["tier"][1] > 0  # all in, out but e, none left
    assert r["blocks_used"].item() == 0 and r["files_left"].item() == 0
    assert r["refused"].item() == 1  # with decodes on the group a switch is refused, and the group goes on
