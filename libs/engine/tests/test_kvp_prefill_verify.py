"""`spindle verify --kvp-prefill N`: Medha's KV parallelism on SmolLM2 fp32 across real processes (gloo) equals the
single engine: the prompt's chunks (a size that does not divide it) computed by three members in turn, each attending
the earlier chunks' KV where it stays, then decodes on the last member over all three shares; the last prompt
token's logits, every decode step's logits and the greedy tokens, and every member gives back every block."""

import pytest

from spindle_engine.esp.verify import verify_kvp
from spindle_engine.esp.verify_worker import KVPVerifySpec
from spindle_engine.sp.verify import main


@pytest.mark.slow
def test_smollm2_prompt_spilled_over_three_members_matches_the_single_engine(smollm2_verify_ref):
    base, ref = smollm2_verify_ref  # 1001 tokens, 6 greedy tokens
    spec = KVPVerifySpec("smollm2", "float32", base.token_ids, members=3, chunk=300,
                         max_new_tokens=base.max_new_tokens)  # fmt: skip
    assert [m for _, _, m in spec.chunks()] == [0, 0, 1, 2]  # 300 + 300 | 300 | 101 tokens
    result = verify_kvp(spec, timeout_s=300, ref=ref)
    print("\n" + result.summary())
    assert result.match, result.summary()
    assert result.blocks_leaked == [0, 0, 0]


@pytest.mark.slow
def test_smollm2_two_pipelines_of_two_stages_match_the_single_engine(smollm2_verify_ref):
    """Medha's 3D: KV parallelism over 2 members, each a pipeline of 2 stages (4 processes); every stage exchanges
    its layers' queries and partial outputs with the same stage of the other member."""
    base, ref = smollm2_verify_ref
    spec = KVPVerifySpec("smollm2", "float32", base.token_ids, members=2, chunk=300,
                         max_new_tokens=base.max_new_tokens, spp=2)  # fmt: skip
    assert [m for _, _, m in spec.chunks()] == [0, 0, 1, 1] and spec.leaders() == [0, 2]
    result = verify_kvp(spec, timeout_s=300, ref=ref)
    print("\n" + result.summary())
    assert result.match, result.summary()
    stages = [r for r in result.ranks if r["stage"] == 1]
    # member 0's stage 1 runs its 2 chunks, member 1's chunks and every decode step (serving queries over its
    # share); member 1's stage 1 runs member 1's chunks and the decodes
    assert [r["steps"] for r in stages] == [4 + base.max_new_tokens - 1, 2 + base.max_new_tokens - 1]


def test_cli_rejects_kvp_prefill_options_that_cannot_run(tmp_path, capsys):
    prompt = tmp_path / "p.json"
    prompt.write_text("[1, 2, 3, 4, 5]")
    for argv, why in [
        (["--kvp-prefill", "1"], "--kvp-prefill must be >= 2"),
        (["--kvp-prefill", "2", "--chunk", "0"], "--chunk must be >= 1"),
        (["--kvp-prefill", "3", "--chunk", "4"], "fewer than 3 members"),
        (["--kvp-prefill", "2", "--plan", "0:@0"], "--kvp-prefill takes no SP plan"),
        (["--kvp-prefill", "2", "--spp", "31", "--chunk", "2"], "--spp must be in [1, 30]"),
    ]:
        assert main(["--prompt-file", str(prompt), *argv]) == 2
        assert why in capsys.readouterr().err
