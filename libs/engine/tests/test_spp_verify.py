"""`spindle verify --spp N`: SmolLM2 fp32 through a sequence pipeline of real processes (gloo) equals the single
engine: the last prompt token's logits, every decode step's logits and the greedy tokens, with a chunk size that
does not divide the prompt and a middle stage that forwards."""

import pytest

from spindle_engine.sp.verify import main
from spindle_engine.spp.verify import verify_spp
from spindle_engine.spp.verify_worker import SPPVerifySpec


@pytest.mark.slow
def test_smollm2_three_stage_pipeline_matches_the_single_engine(smollm2_verify_ref):
    base, ref = smollm2_verify_ref  # 1001 tokens, 6 greedy tokens
    spec = SPPVerifySpec("smollm2", "float32", base.token_ids, spp=3, chunk=300, max_new_tokens=base.max_new_tokens)
    result = verify_spp(spec, timeout_s=300, ref=ref)
    print("\n" + result.summary())
    assert result.match, result.summary()
    leader = result.ranks[0]
    assert leader["steps_not_waited"] == 3, "chunks 1-3 of 4 sample nothing: none of them is waited for"
    assert [r["layers"] for r in result.ranks] == [[0, 10], [10, 20], [20, 30]]
    assert all(r["steps"] == leader["steps"] for r in result.ranks)


@pytest.mark.slow
def test_smollm2_two_stages_of_two_tensor_parallel_ranks_match_the_single_engine(smollm2_verify_ref):
    """Medha's 2D: TP 2 inside each of 2 stages (SmolLM2's 3 KV heads split 2 + 1), 4 processes."""
    base, ref = smollm2_verify_ref
    spec = SPPVerifySpec("smollm2", "float32", base.token_ids, spp=2, chunk=300, max_new_tokens=base.max_new_tokens,
                         tp=2)  # fmt: skip
    result = verify_spp(spec, timeout_s=300, ref=ref)
    print("\n" + result.summary())
    assert result.match, result.summary()
    assert [(r["rank"], r["stage"], r["layers"]) for r in result.ranks] == [
        (0, 0, [0, 15]), (1, 0, [0, 15]), (2, 1, [15, 30]), (3, 1, [15, 30])
    ]  # fmt: skip


def test_cli_rejects_spp_options_that_cannot_run(tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text("[1, 2, 3]")
    for argv, why in [
        (["--spp", "1"], "--spp must be in [2, 30]"),
        (["--spp", "31"], "--spp must be in [2, 30]"),
        (["--spp", "2", "--chunk", "0"], "--chunk must be >= 1"),
        (["--spp", "2", "--plan", "0:@0"], "--spp takes no SP plan"),
        (["--spp", "2", "--stage-tp", "4"], "--stage-tp must be in [1, 3]"),
        (["--plan", "0:@0", "--stage-tp", "2"], "--stage-tp applies to --spp"),
        ([], "--plan is required"),
    ]:
        assert main(["--prompt-file", str(prompt), *argv]) == 2
        assert why in capsys.readouterr().err
