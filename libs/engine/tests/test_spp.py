"""Sequence pipeline parallelism: an engine in layer-range stages over real gloo processes gives the single
engine's tokens, with chunks that do not divide the prompts, mixed prefill/decode steps, sampling and aborts,
and the steps that sample nothing are not waited for (the pipelining)."""

import json

import pytest
import torch

from spindle_engine import Engine, SamplingParams
from spindle_engine.spp import PipelineLayout, SPPLeaderEngine, StageStep, spp_engine_config, stage_layers
from spindle_engine.spp.testing import CONFIG, pipeline_worker, stage_model
from spindle_engine.tp.testing import run_script
from spindle_model.testing import run_gloo, tiny_llama


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 301, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SCRIPT = [
    # 45 tokens in chunks of 7: six steps that sample nothing, then the last 3 tokens
    {"step": 0, "op": "add", "id": "long", "prompt": _prompt(1, 45), "params": {"max_tokens": 9, "temperature": 0}},
    {"step": 2, "op": "add", "id": "b", "prompt": _prompt(2, 9),
     "params": {"max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True, "logprobs": 2}},
    {"step": 3, "op": "add", "id": "c", "prompt": _prompt(3, 5),
     "params": {"max_tokens": 6, "temperature": 1.0, "prompt_logprobs": 1}},
    {"step": 6, "op": "add", "id": "d", "prompt": _prompt(4, 30), "params": {"max_tokens": 8, "temperature": 0}},
    {"step": 9, "op": "abort", "id": "b"},
    {"step": 10, "op": "add", "id": "e", "prompt": _prompt(5, 17), "params": {"max_tokens": 4, "temperature": 0}},
    {"step": 11, "op": "abort", "id": "e"},
    # after every request ended (idle steps: keepalives), a prompt whose first chunks sample nothing again
    {"step": 40, "op": "add", "id": "late", "prompt": _prompt(6, 25), "params": {"max_tokens": 3, "temperature": 0}},
]  # fmt: skip


@pytest.mark.parametrize(
    ("world", "tie", "tp"),
    [(2, False, 1), pytest.param(4, True, 2, marks=pytest.mark.slow)],  # 2 stages x TP 2: 3 KV heads over 2 ranks
)  # test_spp_verify: SmolLM2 (tied) over 3 stages
def test_pipeline_engine_gives_the_single_engine_tokens(world, tie, tp, tmp_path):
    _, model = tiny_llama(tie=tie)
    ref = run_script(Engine(CONFIG, model=model), SCRIPT)
    results = run_gloo(pipeline_worker, world, tmp_path, json.dumps(SCRIPT), tie, tp)
    leader = results[0]
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    assert got == ref
    assert len(ref["long"]) == 9 and len(ref["d"]) == 8 and len(ref["b"]) < 12
    assert leader["blocks_used"].item() == 0
    assert leader["steps_not_waited"].item() >= 6 + 3, "the long prompts' first chunks were waited for"
    assert [r["steps"].item() for r in results[1:]] == [leader["steps"].item()] * (world - 1)


def test_stage_layers_split_the_model_earlier_stages_first():
    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="do not fit"):
        stage_layers(3, 4, 0)
    with pytest.raises(ValueError, match="not one of"):
        stage_layers(30, 2, 2)


def test_a_malformed_step_is_rejected_before_the_cache_is_touched():
    ok = StageStep(1, [0, 8], [1, 5], [[0, 1, 2], [3, 4, 5, 6]], [0, 5])
    assert ok.batch(4, 8).positions == [0, 8, 9, 10, 11, 12]
    bad = {
        "does not fit": StageStep(1, [6], [5], [[0, 1]], []),
        "block id": StageStep(1, [0], [2], [[9]], []),
        "return rows": StageStep(1, [0], [2], [[0]], [2]),
        "lengths": StageStep(1, [0, 1], [2], [[0]], []),
    }
    for match, step in bad.items():
        with pytest.raises(ValueError, match=match):
            step.batch(4, 8)


def test_the_leader_refuses_the_kv_hand_off_with_a_clear_error():
    layout = PipelineLayout.consecutive(0, 2)
    model, head = stage_model(layout, 0)
    leader = SPPLeaderEngine(spp_engine_config(CONFIG, model.config, 2), model, head, layout)
    with pytest.raises(ValueError, match="decodes its own requests"):
        leader.add_request("p", [5, 6, 7], SamplingParams(max_tokens=2), prefill_only=True)
    with pytest.raises(ValueError, match="hand-off"):
        leader.reserve("r", 10)
    with pytest.raises(ValueError, match="stage 0"):
        SPPLeaderEngine(CONFIG, stage_model(PipelineLayout.consecutive(0, 3), 0)[0], head, layout)
    with pytest.raises(ValueError, match="one TP size"):
        PipelineLayout(((0, 1), (2,)))
