"""KV-parallel multi-master decode on real gloo processes, compared with the single-instance engine.

Fast cases run a tiny random-weight Llama (GQA 9:3, weights scaled so greedy continuations vary); the slow
cases run SmolLM2 in fp32. `spindle verify --kvp` cases check the prompt logits, the greedy continuation,
the master's logits at every decode step, the KV each member received and that no member leaked a block;
the group case runs several requests with different masters (and a scale-up) over three members. The cases
of one model run on one launch (`verify_many`); each test case still checks its own result.
"""

import json
import random
import time

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_engine.kvp.testing import GroupRequest, encode_requests, group_worker
from spindle_engine.sp.verify import main, verify_many
from spindle_engine.sp.verify_worker import VerifySpec


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from spindle_model.testing import tiny_llama

    hf, _ = tiny_llama(seed=3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)  # sharper logits: greedy tokens differ step to step
    path = tmp_path_factory.mktemp("tiny-llama-kvp")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _check(result) -> None:
    print(f"\n{result.summary()}")
    assert result.match, result.summary()
    assert result.decode_logit_max_abs_diff is not None
    assert all(r.get("blocks_leaked", 0) == 0 for r in result.ranks)


TINY_KVP = [
    ("0:90@0;90:@0,1", 2, [0, 77], None),  # two prefill holders, KV split at 77 (not block-aligned)
    ("0:@0", 3, None, 3),  # proportional 1:2:3 split, then a fourth member becomes the tail
]
TINY_SCALE_DOWN = [
    (2, [0, 77], 3, None),  # the tail (member 1) leaves: member 0, the master, appends [77, 204) to its [0, 77)
    (3, None, 2, 0),  # the first range's holder and master leaves: member 1 takes [0, 33) in front of its own
]


@pytest.fixture(scope="module")
def tiny_results(tiny_dir):
    """Every tiny-model `spindle verify --kvp` case of this module, on one launch."""
    specs = [
        VerifySpec(
            tiny_dir, "float32", plan, "zigzag", _ids(201, 301), 1, None, 7, dump_kv=True, kvp=kvp, kvp_split=split,
            scale_up_at=scale_up_at,
        )
        for plan, kvp, split, scale_up_at in TINY_KVP
    ] + [
        VerifySpec(
            tiny_dir, "float32", "0:@0", "zigzag", _ids(201, 301), 1, None, 7, kvp=kvp, kvp_split=split,
            scale_down_at=scale_down_at, scale_down_member=member,
        )
        for kvp, split, scale_down_at, member in TINY_SCALE_DOWN
    ]  # fmt: skip
    return dict(zip(map(str, TINY_KVP + TINY_SCALE_DOWN), verify_many(specs, timeout_s=240), strict=True))


@pytest.mark.parametrize(("plan", "kvp", "split", "scale_up_at"), TINY_KVP)
def test_tiny_model_kvp_matches_single_instance(tiny_results, plan, kvp, split, scale_up_at):
    result = tiny_results[str((plan, kvp, split, scale_up_at))]
    _check(result)
    assert len(set(result.tokens)) > 1, "a constant continuation proves little"
    kvp_ranks = [r for r in result.ranks if r["role"] == "kvp"]
    assert len(kvp_ranks) == kvp + (scale_up_at is not None)
    assert all(r["range"] == [] or r["range"][0] % 16 or r["range"][1] % 16 for r in kvp_ranks)
    master = next(r for r in kvp_ranks if r["member"] == 0)
    assert 0 < master["q_bytes"] + master["kv_bytes"] < master["kv_move_bytes"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_model_kvp_matches_on_cuda(tiny_dir):
    """Every rank on GPU 0 (host-staged gloo between them), a scale-up and a scale-down included."""
    specs = [
        VerifySpec(tiny_dir, "float32", "0:90@0;90:@0,1", "zigzag", _ids(201, 301), 1, None, 7, dump_kv=True, kvp=2,
                   kvp_split=[0, 77], scale_up_at=3, device="cuda:0"),
        VerifySpec(tiny_dir, "float32", "0:@0", "zigzag", _ids(201, 301), 1, None, 7, kvp=3, scale_down_at=2,
                   scale_down_member=0, device="cuda:0"),
    ]  # fmt: skip
    for result in verify_many(specs, timeout_s=240):
        _check(result)


@pytest.mark.parametrize(("kvp", "split", "scale_down_at", "member"), TINY_SCALE_DOWN)
def test_tiny_model_kvp_scale_down_matches_single_instance(tiny_results, kvp, split, scale_down_at, member):
    result = tiny_results[str((kvp, split, scale_down_at, member))]
    _check(result)
    kvp_ranks = {r["member"]: r for r in result.ranks if r["role"] == "kvp"}
    leaver = kvp_ranks[kvp - 1 if member is None else member]
    lo, hi = leaver["range"]
    assert lo % 16 or hi % 16  # not a block boundary
    moved = hi - lo + (scale_down_at - 1 if lo and member is None else 0)  # the tail grew before it left
    per_token = 3 * 2 * 3 * 8 * 4  # layers x (K, V) x KV heads x head dim x fp32: the theory
    assert leaver["scale_down_tokens"] == moved and leaver["scale_down_bytes"] == moved * per_token
    assert sum(r["scale_down_bytes"] for r in kvp_ranks.values()) == leaver["scale_down_bytes"]


def test_cli_rejects_bad_kvp_options(tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(_ids(50, 300)))
    base = ["--prompt-file", str(prompt), "--plan", "0:@0"]
    assert main([*base, "--kvp", "2", "--decode-tp", "2"]) == 2
    assert "not supported yet" in capsys.readouterr().err
    assert main([*base, "--scale-up-at", "2"]) == 2
    assert main([*base, "--kvp", "2", "--scale-up-at", "8"]) == 2  # not before the last of 8 tokens
    assert main([*base, "--kvp", "2", "--kvp-split", "0,20,30"]) == 2
    assert "ranges for --kvp 2" in capsys.readouterr().err
    assert main([*base, "--kvp", "2", "--kvp-split", "5,20"]) == 2
    assert main([*base, "--kvp", "60"]) == 2
    assert main([*base, "--scale-down-at", "2"]) == 2
    assert "needs --kvp" in capsys.readouterr().err
    assert main([*base, "--kvp", "1", "--scale-down-at", "2"]) == 2
    assert "two KV holders" in capsys.readouterr().err
    assert main([*base, "--kvp", "2", "--scale-down-at", "2", "--scale-down-member", "2"]) == 2
    assert main([*base, "--kvp", "2", "--scale-down-member", "1"]) == 2
    assert main([*base, "--kvp", "2", "--scale-down-at", "3", "--scale-up-at", "3", "--scale-down-member", "2"]) == 2
    assert "only after --scale-up-at" in capsys.readouterr().err


def _engine_reference(model_dir: str, requests: list[GroupRequest]) -> dict[str, list[int]]:
    engine = Engine(EngineConfig(model=model_dir, block_size=16, kv_cache_tokens=2048, max_model_len=512))
    for r in requests:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, ignore_eos=True)
        engine.add_request(r.request_id, r.token_ids, params)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_multi_master_group_matches_single_engine(tiny_dir, tmp_path):
    """Three requests, mastered by members 0, 2 and 1, over three members; one scales up mid-generation,
    one samples with a seeded temperature."""
    from spindle_model import CausalAttention, LlamaModel, load_state_dict, resolve_model
    from spindle_model.testing import run_gloo

    requests = [
        GroupRequest("a", _ids(150, 301, 1), 0, [0, 1, 2], [0, 37, 101, 150], 7),
        GroupRequest("b", _ids(93, 301, 2), 2, [1, 0], [0, 45, 93], 6, [[2, 2]]),  # 2 becomes b's tail
        # mastered by a member holding none of it; seeded temperature sampling, as the engine samples
        GroupRequest("c", _ids(60, 301, 3), 1, [2], [0, 60], 5, temperature=0.8, seed=11),
    ]
    results = run_gloo(group_worker, 3, tmp_path, tiny_dir, encode_requests(requests), timeout=120)
    ref = _engine_reference(tiny_dir, requests)
    source = resolve_model(tiny_dir)
    model = LlamaModel(source.config)
    model.load_weights(load_state_dict(source.path))
    for r in requests:
        got = results[r.master]
        tokens = got[f"tokens:{r.request_id}"].tolist()
        assert tokens == ref[r.request_id], r.request_id
        assert len(set(tokens)) > 1
        with torch.inference_mode():  # one causal pass: the logits that chose tokens[1:]
            ids = torch.tensor(r.token_ids + tokens[:-1])
            full = model.compute_logits(model(torch.arange(len(ids)), CausalAttention(), input_ids=ids))
        diff = (got[f"logits:{r.request_id}"] - full[len(r.token_ids) :]).abs().max().item()
        assert diff < 1e-4 * full.abs().max().item(), (r.request_id, diff)
    for rank, res in enumerate(results):
        assert int(res["blocks_used"]) == 0, f"member {rank} leaked blocks"
    q, kv, states, control, move, steps = results[0]["bytes"].tolist()
    assert steps == 6 and q > 0 and kv > 0 and states > 0 and control > 0 and move > q + kv


# ---- SmolLM2, fp32 ----


SMOL_KVP = [
    ("0:500@0;500:@0,1", 2, [0, 413], None),  # a growing SP plan into KVP 2
    ("0:@0,1", 3, None, 3),  # KVP 3 with a scale-up to a fourth member
]
SMOL_SCALE_DOWN = [(1, 2)]  # the tail leaving: the tiny-model cases


@pytest.fixture(scope="module")
def smol_results(smollm2_verify_ref):
    """Every SmolLM2 case of this module on one launch, against the shared single-instance reference."""
    base, ref = smollm2_verify_ref
    ids = _ids(1001, 49152, 7)
    assert base.token_ids == ids and base.max_new_tokens == 6
    specs = [
        VerifySpec(
            "smollm2", "float32", plan, "zigzag", ids, 1, None, 6, dump_kv=True, kvp=kvp, kvp_split=split,
            scale_up_at=scale_up_at,
        )
        for plan, kvp, split, scale_up_at in SMOL_KVP
    ] + [
        VerifySpec(
            "smollm2", "float32", "0:@0", "zigzag", ids, 1, None, 6, kvp=3, scale_down_at=scale_down_at,
            scale_down_member=member,
        )
        for member, scale_down_at in SMOL_SCALE_DOWN
    ]  # fmt: skip
    results = verify_many(specs, timeout_s=900, refs=[ref] * len(specs))
    return dict(zip(map(str, SMOL_KVP + SMOL_SCALE_DOWN), results, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "kvp", "split", "scale_up_at"), SMOL_KVP)
def test_smollm2_kvp_matches_single_instance(smol_results, plan, kvp, split, scale_up_at):
    _check(smol_results[str((plan, kvp, split, scale_up_at))])


@pytest.mark.slow
@pytest.mark.parametrize(("member", "scale_down_at"), SMOL_SCALE_DOWN)
def test_smollm2_kvp_scale_down_matches_single_instance(smol_results, member, scale_down_at):
    """KVP 3 over [0, 167), [167, 500), [500, 1001): member 1's range moves to the end of member 0's (the
    master's) after 2 tokens."""
    result = smol_results[str((member, scale_down_at))]
    _check(result)
    leaver = next(r for r in result.ranks if r.get("role") == "kvp" and r["scale_down_tokens"])
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x KV heads x head dim x fp32
    assert leaver["scale_down_bytes"] == leaver["scale_down_tokens"] * per_token


def test_member_killed_mid_decode_fails_the_others_cleanly(tiny_dir, tmp_path, monkeypatch):
    """The tail holder dies between decode steps: the master's next exchange with it fails, so does the other
    holder's with the master; both give back every block and the run ends with an error, not a hang."""
    from spindle_engine.sp.verify import launch

    monkeypatch.setenv("SPINDLE_VERIFY_KILL_KVP", "2:2")  # KVP member 2 (the tail), before decode step 2
    spec = VerifySpec(tiny_dir, "float32", "0:@0", "zigzag", _ids(150, 301), 1, None, 6, kvp=3)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="verify ranks failed"):
        launch(spec, tmp_path, timeout_s=120)
    assert time.monotonic() - t0 < 60
    assert "killed before step 2" in (tmp_path / "rank3.log").read_text()  # rank 0 prefills, 1..3 decode
    for j in (0, 1):
        log = (tmp_path / f"rank{1 + j}.log").read_text()
        assert f"KVP member {j}: decode failed" in log and "blocks still held: 0" in log, log[-2000:]
