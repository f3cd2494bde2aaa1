"""KV sent straight from the holders to each rank of a tensor-parallel decode instance: position runs, the
follower's receives, and the lockstep engine with direct imports giving the single engine's tokens."""

import json
import threading
from concurrent.futures import Future

import pytest
import torch

from spindle_engine import Engine
from spindle_engine.sp import split_for_decode
from spindle_engine.sp.kv_parts import decode_heads
from spindle_engine.tp import DirectReceives, from_runs, slice_bytes, to_runs
from spindle_engine.tp.testing import CONFIG, lockstep_worker, run_script
from spindle_model.testing import run_gloo, tiny_llama


@pytest.mark.parametrize(
    "positions",
    [[], [0], [5, 6, 7], [0, 1, 2, 9, 10, 4, 5], [7, 6, 5], list(range(0, 20, 2)), [3, 4, 0, 1, 2]],
)
def test_runs_round_trip_in_order(positions):
    runs = to_runs(positions)
    assert from_runs(runs).tolist() == positions
    assert all(s < e for s, e in runs)


def test_runs_of_a_zigzag_share_are_few():
    n, sp = 1001, 2
    chunk = -(-n // (2 * sp))
    share = [*range(0, chunk), *range(3 * chunk, n)]  # rank 0 of a zigzag over 2: first and last chunk
    assert to_runs(share) == [[0, chunk], [3 * chunk, n]]


def test_bad_runs_are_refused():
    for runs in ([[3, 3]], [[-1, 2]], [[1]]):
        with pytest.raises(ValueError):
            from_runs(runs)


def test_slice_bytes_of_smollm2_over_two_ranks():
    # SmolLM2: 30 layers, 3 KV heads of 64, TP 2 -> heads 2 and 1
    assert slice_bytes(100, 30, 2, 64, torch.float32) == 100 * 2 * 64 * 2 * 30 * 4
    assert slice_bytes(100, 30, 1, 64, torch.bfloat16) == 100 * 64 * 2 * 30 * 2


def test_split_by_decode_heads_is_uneven_and_covers_every_head():
    _, model = tiny_llama()
    heads = decode_heads(model.config, 2)
    kv = torch.randn(2, 3, 5, model.config.num_kv_heads, model.config.head_dim)
    parts = split_for_decode(kv, heads)
    assert [p.shape[3] for p in parts] == [hi - lo for lo, hi in heads] and sum(p.shape[3] for p in parts) == 3
    assert torch.equal(torch.cat(parts, dim=3), kv)


class FakeReceiver:
    """Resolves each receive with the tensor registered for (src, tag); records the cancel events."""

    def __init__(self, tensors: dict[tuple[int, int], torch.Tensor]) -> None:
        self.tensors = tensors
        self.cancels: list[threading.Event] = []

    def __call__(self, src: int, tag: int, shape, dtype, cancel: threading.Event) -> Future:
        self.cancels.append(cancel)
        f: Future = Future()
        t = self.tensors.get((src, tag))
        if t is None:
            return f  # never arrives
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype
        f.set_result(t)
        return f


def _shape(n: int) -> tuple[int, ...]:
    return (2, 3, n, 1, 4)


def test_direct_receives_put_the_parts_in_place():
    full = torch.randn(_shape(9))
    a, b = torch.tensor([0, 1, 2, 7, 8]), torch.tensor([3, 4, 5, 6])
    rx = FakeReceiver({(1, 10): full[:, :, a].clone(), (2, 11): full[:, :, b].clone()})
    d = DirectReceives(rx, _shape, torch.float32)
    d.post("r", 1, 10, to_runs(a))
    d.post("r", 2, 11, to_runs(b))
    assert "r" in d
    assert torch.equal(d.take("r", 9, 1.0), full)
    assert d.bytes == full.numel() * 4 and "r" not in d
    with pytest.raises(ValueError):
        d.take("r", 9, 1.0)


def test_direct_receives_refuse_missing_positions_and_stop_on_drop():
    full = torch.randn(_shape(4))
    rx = FakeReceiver({(1, 10): full[:, :, :3].clone()})
    d = DirectReceives(rx, _shape, torch.float32)
    d.post("r", 1, 10, [[0, 3]])
    with pytest.raises(ValueError, match="missing"):
        d.take("r", 4, 1.0)
    d.post("s", 1, 99, [[0, 4]])  # never arrives
    d.drop("s")
    assert rx.cancels[-1].is_set() and "s" not in d
    d.post("t", 1, 99, [[0, 4]])
    with pytest.raises(TimeoutError):
        d.take("t", 4, 0.05)
    assert rx.cancels[-1].is_set()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 301, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SCRIPT = [
    {"step": 0, "op": "add", "id": "a", "prompt": _prompt(1, 19), "params": {"max_tokens": 8, "temperature": 0}},
    {"step": 1, "op": "direct", "id": "c", "prompt": _prompt(3, 31), "params": {"max_tokens": 10, "temperature": 0}},
    {
        "step": 2,
        "op": "direct",
        "id": "d",
        "prompt": _prompt(4, 26),
        "params": {"max_tokens": 9, "temperature": 0.8, "seed": 3, "ignore_eos": True},
    },
    {"step": 3, "op": "resume", "id": "e", "prompt": _prompt(5, 11), "params": {"max_tokens": 5, "temperature": 0}},
]


def test_lockstep_with_direct_imports_gives_the_single_engine_tokens(tmp_path):
    _, model = tiny_llama()
    ref = run_script(Engine(CONFIG, model=model), SCRIPT)
    results = run_gloo(lockstep_worker, 2, tmp_path, json.dumps(SCRIPT))
    leader, follower = results
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    assert got == ref
    c = model.config
    (lo0, hi0), (lo1, hi1) = decode_heads(c, 2)
    direct_tokens = 31 + 26  # c and d came directly; e (a whole import) was forwarded
    assert leader["direct_bytes"].item() == slice_bytes(
        direct_tokens, c.num_layers, hi0 - lo0, c.head_dim, torch.float32
    )
    want = slice_bytes(direct_tokens, c.num_layers, hi1 - lo1, c.head_dim, torch.float32)
    assert follower["direct_bytes"].item() == want and leader["follower_direct_bytes"].tolist() == [want]
    assert leader["forwarded_bytes"].item() == slice_bytes(11, c.num_layers, hi1 - lo1, c.head_dim, torch.float32)
    assert leader["blocks_used"].item() == 0 and follower["blocks_used"].item() == 0
