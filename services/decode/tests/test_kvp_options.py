"""`--kvp-size` / `--kvp-tokens` / `--kvp-scale-down-tokens` of the decode instance and `spindle up --decode-kvp`
(flags, ranks, refusals)."""

import pytest

from spindle_decode.__main__ import build_parser
from spindle_decode.__main__ import main as decode_main
from spindle_decode.kvp_follower import main as follower_main
from spindle_decode.kvp_lockstep import KVPOptions
from spindle_launcher.plan import Runtime, StackConfig, build_plan

RUNTIME = Runtime(nats_url="nats://127.0.0.1:4222", dist_init="tcp://127.0.0.1:29500", port=8000)


def test_kvp_members_take_consecutive_ranks_after_their_leader():
    config = StackConfig(prefill=1, decode=2, decode_kvp=3, kvp_tokens=500, kvp_scale_down_tokens=64, port=8000)
    assert config.world_size == 1 + 1 + 2 * 3
    specs = {s.name: s for s in build_plan(config, RUNTIME)}
    leader = specs["decode-1"].args
    assert leader[leader.index("--rank") + 1] == "5"
    assert leader[leader.index("--kvp-size") + 1] == "3" and leader[leader.index("--kvp-tokens") + 1] == "500"
    assert leader[leader.index("--kvp-scale-down-tokens") + 1] == "64"
    assert build_parser().parse_args(leader).kvp_scale_down_tokens == 64
    for j, rank in ((1, "6"), (2, "7")):
        f = specs[f"decode-1-kvp{j}"]
        assert f.module == "spindle_decode.kvp_follower"
        assert f.args[f.args.index("--rank") + 1] == rank and f.args[f.args.index("--leader-rank") + 1] == "5"
        assert f.args[f.args.index("--world-size") + 1] == "8"
    assert "decode-0-kvp3" not in specs and not any("tp" in n.split("-")[-1] for n in specs if "kvp" not in n)
    scheduler = specs["scheduler"].args  # the scheduler places over the members with the same token limit
    assert scheduler[scheduler.index("--strategy") + 1] == "single:kvp_tokens=500"


def test_kvp_tokens_joins_the_strategys_options_unless_the_strategy_sets_it():
    def strategy(**kw) -> str:
        args = {s.name: s for s in build_plan(StackConfig(decode_kvp=2, port=8000, **kw), RUNTIME)}["scheduler"].args
        return args[args.index("--strategy") + 1]

    assert strategy() == "single"
    sp = strategy(kvp_tokens=300, strategy="request-sp:max_sp=2", profile="p.json")
    assert sp == "request-sp:max_sp=2,kvp_tokens=300"
    assert strategy(kvp_tokens=300, strategy="single:kvp_tokens=900") == "single:kvp_tokens=900"


def test_bad_kvp_stacks_are_refused():
    with pytest.raises(ValueError, match="decode_tp 1"):
        StackConfig(decode_kvp=2, decode_tp=2)
    with pytest.raises(ValueError, match="decode_kvp"):
        StackConfig(decode_kvp=0)
    with pytest.raises(ValueError, match="decode_kvp > 1"):
        StackConfig(kvp_tokens=100)
    with pytest.raises(ValueError, match="non-negative"):
        StackConfig(decode_kvp=2, kvp_tokens=-1)
    with pytest.raises(ValueError, match="decode_kvp > 1"):
        StackConfig(kvp_scale_down_tokens=16)
    with pytest.raises(ValueError, match="non-negative"):
        StackConfig(decode_kvp=2, kvp_scale_down_tokens=-1)
    with pytest.raises(ValueError):
        KVPOptions(0)
    with pytest.raises(ValueError, match="scale-down"):
        KVPOptions(2, 500, -1)
    assert KVPOptions(2).scale_down_tokens == 0  # off unless asked for


def test_decode_cli_refuses_kvp_with_tp_and_ranks_outside_the_world(capsys):
    base = ["--instance-id", "decode-0", "--rank", "2", "--world-size", "4"]
    with pytest.raises(SystemExit):
        decode_main([*base, "--kvp-size", "2", "--tp-size", "2"])
    assert "--tp-size 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decode_main([*base, "--kvp-size", "3"])
    assert "exceeds --world-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        follower_main(["--rank", "2", "--leader-rank", "2", "--kvp-size", "2", "--world-size", "4"])
    assert "not a follower" in capsys.readouterr().err
    assert "kvp_follower" in build_parser().format_help()
