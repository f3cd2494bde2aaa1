"""A tensor-parallel engine in SPMD lockstep (leader mirrors its calls, followers replay) over real gloo
processes gives the single engine's tokens, with adds, KV imports and aborts between steps."""

import json

import pytest
import torch

from spindle_engine import Engine
from spindle_engine.tp.testing import CONFIG, lockstep_worker, run_script
from spindle_model.testing import run_gloo, tiny_llama


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 301, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SCRIPT = [
    {"step": 0, "op": "add", "id": "a", "prompt": _prompt(1, 23), "params": {"max_tokens": 14, "temperature": 0}},
    {
        "step": 0,
        "op": "add",
        "id": "b",
        "prompt": _prompt(2, 9),
        "params": {"max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True},
    },
    {"step": 2, "op": "resume", "id": "c", "prompt": _prompt(3, 31), "params": {"max_tokens": 10, "temperature": 0}},
    {"step": 3, "op": "add", "id": "d", "prompt": _prompt(4, 5), "params": {"max_tokens": 6, "temperature": 1.0}},
    {"step": 5, "op": "abort", "id": "a"},
    {"step": 6, "op": "add", "id": "e", "prompt": _prompt(5, 17), "params": {"max_tokens": 4, "temperature": 0}},
    {"step": 7, "op": "abort", "id": "e"},
]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lockstep_tp_engine_gives_the_single_engine_tokens(world, tmp_path):
    _, model = tiny_llama()
    ref = run_script(Engine(CONFIG, model=model), SCRIPT)
    results = run_gloo(lockstep_worker, world, tmp_path, json.dumps(SCRIPT))
    leader = results[0]
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    assert got == ref
    assert len(ref["c"]) == 10 and len(ref["b"]) == 12 and len(ref["a"]) < 14
    assert leader["blocks_used"].item() == 0
    assert leader["follower_blocks_used"].tolist() == [0] * (world - 1)
    assert [r["blocks_used"].item() for r in results[1:]] == [0] * (world - 1)
