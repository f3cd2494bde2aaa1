"""SP prefill end to end through `spindle verify`: real processes on a gloo group, compared with one instance.

Fast cases run a tiny random-weight Llama (GQA 9:3); the slow matrix runs SmolLM2 in fp32 with prompt
lengths not divisible by 2 * SP. Each case checks the last prompt token's logits, the greedy continuation
on the decode side (single or TP=2), the whole prompt KV the decode side assembled, and that no member
leaked a KV block. The cases of one parametrized test run on one launch (`verify_many`: the processes start
and load the model once, then run every case in turn); each test case still checks its own result.
"""

import json
import random
import time

import pytest
import torch

from spindle_engine.sp.verify import compare, launch, main, reference, verify, verify_many
from spindle_engine.sp.verify_worker import VerifySpec


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from spindle_model.testing import tiny_llama

    hf, _ = tiny_llama(seed=3)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _check(result) -> None:
    print(f"\n{result.summary()}")
    assert result.match, result.summary()
    assert result.kv_max_abs_diff is None or result.kv_max_abs_diff <= 1e-4 * max(result.logit_scale, 1.0)


TINY_PLANS = [
    ("0:60@0;60:150@0,1;150:@0,1,2,3", "zigzag", 2, None),  # grows 1 -> 2 -> 4, TP=2 decode
    ("0:100@0,1/stripe;100:@0,1,2/all-to-all", "zigzag", 1, None),  # 2 -> 3, layouts mixed
    ("0:90@1;90:@1,0,2", "contiguous", 1, [0]),  # retention on one member, which decodes in place
    ("0:90@0,1;90:@0,1,2", "stripe", 2, [2, 0]),  # retention on two members, sent on to TP=2 decode
]


@pytest.fixture(scope="module")
def tiny_results(tiny_dir):
    specs = [
        VerifySpec(tiny_dir, "float32", plan, layout, _ids(201, 301), tp, retain, 6, dump_kv=True)
        for plan, layout, tp, retain in TINY_PLANS
    ]
    return dict(zip(map(str, TINY_PLANS), verify_many(specs, timeout_s=240), strict=True))


@pytest.mark.parametrize(("plan", "layout", "decode_tp", "retain"), TINY_PLANS)
def test_tiny_model_plans_match_single_instance(tiny_results, plan, layout, decode_tp, retain):
    _check(tiny_results[str((plan, layout, decode_tp, retain))])


def test_a_wrong_result_is_reported_as_mismatch(tiny_dir, tmp_path):
    spec = VerifySpec(tiny_dir, "float32", "0:50@0;50:@0,1", "zigzag", _ids(101, 301, 1), 1, None, 4, dump_kv=True)
    logits, tokens, kv = reference(spec)
    results = launch(spec, tmp_path, timeout_s=120)
    assert compare(spec, results, (logits, tokens, kv)).match
    assert not compare(spec, results, (logits + 1e-2, tokens, kv)).match
    assert not compare(spec, results, (logits, [*tokens[:-1], tokens[-1] + 1], kv)).match
    assert not compare(spec, results, (logits, tokens, kv + 1e-2)).match


def test_cli_rejects_bad_input_before_starting_processes(tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(_ids(50, 300)))
    assert main(["--prompt-file", str(prompt), "--plan", "0:20@0;20:@1"]) == 2
    assert "contain the previous" in capsys.readouterr().err
    assert main(["--prompt-file", str(prompt), "--plan", "0:@0,1", "--retain", "5"]) == 2
    assert main(["--prompt-file", str(prompt), "--plan", "0:@0,1", "--decode-tp", "0"]) == 2
    assert main(["--prompt-file", str(prompt), "--plan", "0:@0,1", "--layouts", "zigzag,diagonal"]) == 2
    assert "--layouts must name layouts" in capsys.readouterr().err
    a2a = ["--prompt-file", str(prompt), "--plan", "0:@0,1,2", "--layout", "all-to-all"]
    assert main([*a2a, "--csa-drop", "1.0"]) == 2
    assert main(["--prompt-file", str(prompt), "--plan", "0:20@0,1;20:@0,1,2", "--csa-drop", "0.2"]) == 2
    assert "one-chunk plan" in capsys.readouterr().err
    assert main([*a2a, "--csa-drop", "0.2", "--csa-levels", "4"]) == 2
    assert "--csa-levels must be in [1, 3]" in capsys.readouterr().err
    assert main([*a2a, "--csa-levels", "2"]) == 2
    assert main([*a2a, "--csa-rule", "printed"]) == 2
    assert "need --csa-drop" in capsys.readouterr().err
    prompt.write_text('["a"]')
    assert main(["--prompt-file", str(prompt), "--plan", "0:@0"]) == 2


def test_cli_device_is_checked_before_starting_processes(tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(_ids(50, 300)))
    argv = ["--prompt-file", str(prompt), "--plan", "0:20@0;20:@0,1"]
    assert main([*argv, "--device", "gpu"]) == 2
    assert "device must be 'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err
    assert main(["--prompt-file", str(prompt), "--spp", "2", "--chunk", "20", "--device", "cuda"]) == 2
    assert "--spp runs on the CPU only" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*argv, "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    else:
        assert main([*argv, "--layout", "all-to-all", "--csa-drop", "0", "--device", "cuda"]) == 2
        assert "not with --csa-drop" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("plan", "layout", "decode_tp", "retain"), [TINY_PLANS[0], TINY_PLANS[3]])
def test_tiny_model_plans_match_on_cuda(tiny_dir, plan, layout, decode_tp, retain):
    """Every rank on GPU 0 (host-staged gloo between them); the reference on the CPU."""
    spec = VerifySpec(tiny_dir, "float32", plan, layout, _ids(201, 301), decode_tp, retain, 6, dump_kv=True,
                      device="cuda:0")  # fmt: skip
    _check(verify(spec, timeout_s=240))


def test_cli_runs_a_plan_and_prints_match(tiny_dir, tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(_ids(77, 301, 2)))
    out = tmp_path / "r.json"
    argv = ["--prompt-file", str(prompt), "--plan", "0:30@0;30:@0,1", "--model", tiny_dir, "--json", str(out)]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith("MATCH")
    assert json.loads(out.read_text())["match"] is True


def test_cli_runs_a_plan_per_layout_on_one_launch(tiny_dir, tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(_ids(77, 301, 2)))
    out = tmp_path / "r.json"
    argv = ["--prompt-file", str(prompt), "--plan", "0:30@0;30:@0,1", "--model", tiny_dir, "--json", str(out)]
    assert main([*argv, "--layouts", "contiguous,all-to-all"]) == 0
    printed = capsys.readouterr().out
    assert "--- layout contiguous" in printed and "--- layout all-to-all" in printed
    assert printed.count("MATCH") == 2
    docs = json.loads(out.read_text())
    assert [d["layout"] for d in docs] == ["contiguous", "all-to-all"] and all(d["match"] for d in docs)
    chunk_layouts = [c["layout"] for d in docs for r in d["ranks"] if r.get("role") == "prefill" for c in r["chunks"]]
    assert set(chunk_layouts) == {"contiguous", "all-to-all"}


def test_csa_over_all_to_all_matches_with_nothing_dropped_and_reports_agreement_with_drops(tiny_dir, capsys):
    ids = _ids(203, 301, 5)
    specs = [
        VerifySpec(tiny_dir, "float32", "0:@0,1,2,3", "all-to-all", ids, 1, None, 6, dump_kv=True, csa_drop=0.0),
        VerifySpec(tiny_dir, "float32", "0:@0,1,2", "all-to-all", ids, 1, None, 6, csa_drop=0.0, csa_levels=2),
        VerifySpec(tiny_dir, "float32", "0:@0,1,2,3", "all-to-all", ids, 1, None, 6, csa_drop=0.3),
        VerifySpec(tiny_dir, "float32", "0:@0,1,2,3", "all-to-all", ids, 1, None, 6, csa_drop=0.7, csa_rule="printed"),
    ]
    exact, two_levels, sparse, printed = verify_many(specs, timeout_s=240)
    _check(exact)
    _check(two_levels)
    assert sparse.approximate and sparse.match  # only a leak fails an approximation
    assert sparse.logit_max_abs_diff > 1e-4  # the drops changed something
    assert "APPROXIMATE" in sparse.summary() and "greedy-token agreement" in sparse.summary()

    def chunks(result):
        return [c for r in result.ranks if r.get("role") == "prefill" for c in r["chunks"]]

    assert all(c["csa_dropped_tokens"] == 0 for c in chunks(exact))
    # 203 tokens over 4: segments 51, 51, 51, 50; level 2 drops 30 % of each (rounded)
    assert sorted(c["csa_dropped_tokens"] for c in chunks(sparse)) == [15, 15, 15, 15]
    # the printed rule at 0.7: level 2 keeps 30 % (15 of 51, 15 of 50), level 3 60 %
    assert printed.approximate and printed.match
    assert sorted(c["csa_dropped_tokens"] for c in chunks(printed)) == [35, 36, 36, 36]
    total = sum(sum(c["bytes_by_phase"].values()) for c in chunks(sparse))
    assert 0 < total < sum(sum(c["bytes_by_phase"].values()) for c in chunks(exact))


# ---- SmolLM2, fp32 ----

# every layout at SP 3 (1001 tokens do not divide by 3), one each at SP 2 and 4; the tiny model runs every pair
SMOL_SINGLE_CHUNK = [(2, "stripe"), (4, "all-to-all")] + [
    (3, lay) for lay in ("contiguous", "stripe", "zigzag", "all-to-all")
]


@pytest.fixture(scope="module")
def smol_single_chunk_results(smollm2_verify_ref):
    base, ref = smollm2_verify_ref
    specs = [
        VerifySpec("smollm2", "float32", f"0:@{','.join(map(str, range(sp)))}", layout, base.token_ids, 1, None, 6,
                   dump_kv=True)
        for sp, layout in SMOL_SINGLE_CHUNK
    ]  # fmt: skip
    return dict(zip(SMOL_SINGLE_CHUNK, verify_many(specs, timeout_s=600, refs=[ref] * len(specs)), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("sp", "layout"), SMOL_SINGLE_CHUNK)
def test_smollm2_single_chunk_sp_matches(smol_single_chunk_results, sp, layout):
    result = smol_single_chunk_results[sp, layout]
    _check(result)
    chunks = [c for r in result.ranks if r.get("role") == "prefill" for c in r["chunks"]]
    assert {(c["sp"], c["layout"]) for c in chunks} == {(sp, layout)}


SMOL_LONG_PLANS = [
    ("0:500@0;500:1300@0,1;1300:@0,1,2,3", "stripe", 2, None),  # 1 -> 2 -> 4, TP=2 decode
    ("0:1100@0,1;1100:@0,1,2", "zigzag", 1, [0]),  # 2 -> 3, retained on member 0, decoded in place
    ("0:900@0,1;900:@0,1,2", "all-to-all", 2, None),
]


@pytest.fixture(scope="module")
def smol_long_results():
    ids = _ids(1877, 49152, 8)  # longer than a chunk of any plan; no chunk divides evenly
    specs = [
        VerifySpec("smollm2", "float32", plan, layout, ids, tp, retain, 6, dump_kv=True)
        for plan, layout, tp, retain in SMOL_LONG_PLANS
    ]
    return dict(zip(map(str, SMOL_LONG_PLANS), verify_many(specs, timeout_s=900), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "layout", "decode_tp", "retain"), SMOL_LONG_PLANS)
def test_smollm2_long_prompt_growing_groups_match(smol_long_results, plan, layout, decode_tp, retain):
    _check(smol_long_results[str((plan, layout, decode_tp, retain))])


def test_member_killed_mid_chunk_fails_the_others_cleanly(tiny_dir, tmp_path, monkeypatch):
    """A member dies inside a chunk: its peers' ring waits end with an error (no hang) and free their blocks."""
    monkeypatch.setenv("SPINDLE_VERIFY_KILL", "2:1")  # member 2, layer 1 of its first (= second) chunk
    spec = VerifySpec(tiny_dir, "float32", "0:80@0,1;80:@0,1,2", "zigzag", _ids(201, 301, 4), 1, None, 4)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with an error"):
        launch(spec, tmp_path, timeout_s=120)
    assert time.monotonic() - t0 < 60
    assert "killed at layer 1" in (tmp_path / "rank2.log").read_text()
    for r in (0, 1):
        log = (tmp_path / f"rank{r}.log").read_text()
        assert f"member {r}: prefill failed" in log and "blocks still held: 0" in log, log[-2000:]
