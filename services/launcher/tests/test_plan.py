"""The pure plan: ranks, world size, flags forwarded, invalid configs."""

import pytest

from spindle_launcher.plan import Runtime, StackConfig, build_plan, check_decode_tp

RT = Runtime(nats_url="nats://127.0.0.1:4333", dist_init="tcp://127.0.0.1:29777", port=8123, parent_pid=4242)


def flags(args: tuple[str, ...]) -> dict[str, str]:
    """--flag value pairs (every flag of the plan takes a value)."""
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    out = dict(zip(args[::2], args[1::2], strict=True))
    assert len(out) == len(args) // 2, f"repeated flag in {args}"
    return out


def test_default_plan_names_ranks_and_common_flags() -> None:
    specs = build_plan(StackConfig(), RT, python="/py")
    assert [s.name for s in specs] == ["kvstore-0", "scheduler", "prefill-0", "prefill-1", "decode-0", "gateway"]
    roles = ["kvstore", "scheduler", "prefill", "prefill", "decode", "gateway"]
    assert [s.module for s in specs] == [f"spindle_{r}" for r in roles]
    for s in specs:
        assert s.argv[:3] == ("/py", "-m", s.module)
        f = flags(s.args)
        assert f["--nats-url"] == RT.nats_url and f["--parent-pid"] == "4242"
        assert "--otlp-endpoint" not in f
        assert s.env["PYTHONUNBUFFERED"] == "1"
    workers = {s.name: flags(s.args) for s in specs if s.role in ("kvstore", "prefill", "decode")}
    ranks = {n: int(f["--rank"]) for n, f in workers.items()}
    assert ranks == {"kvstore-0": 0, "prefill-0": 1, "prefill-1": 2, "decode-0": 3}
    for name, f in workers.items():
        assert f["--instance-id"] == name and f["--world-size"] == "4" and f["--dist-init"] == RT.dist_init
    gateway = flags(specs[-1].args)
    assert (gateway["--host"], gateway["--port"], gateway["--model"]) == ("127.0.0.1", "8123", "smollm2")
    assert flags(specs[1].args)["--strategy"] == "single"
    assert StackConfig().instance_ids() == ["kvstore-0", "prefill-0", "prefill-1", "decode-0"]


def test_flags_forwarded() -> None:
    config = StackConfig(
        model="/models/llama",
        dtype="bfloat16",
        prefill=3,
        decode=2,
        host="0.0.0.0",
        strategy="other",
        kv_cache_tokens=4096,
        kv_cache_memory_gb=0.5,
        decode_kv_cache_tokens=64,
        max_model_len=2048,
        default_max_tokens=256,
        kvstore_memory_gb=2.0,
        otlp_endpoint="http://127.0.0.1:4317",
        log_level="debug",
        extra_args={"scheduler": ("--max-num-requests", "7")},
        env={"SPINDLE_TRACE_FILE": "/tmp/t.jsonl"},
    )
    specs = {s.name: s for s in build_plan(config, RT)}
    assert config.world_size == 6
    assert [n for n in specs if n.startswith("decode")] == ["decode-0", "decode-1"]
    assert flags(specs["decode-1"].args)["--rank"] == "5"
    for s in specs.values():
        f = flags(s.args)
        assert f["--otlp-endpoint"] == "http://127.0.0.1:4317" and f["--log-level"] == "DEBUG"
        assert s.env["SPINDLE_TRACE_FILE"] == "/tmp/t.jsonl"
        if s.role in ("prefill", "decode"):
            assert (f["--model"], f["--dtype"], f["--max-model-len"]) == ("/models/llama", "bfloat16", "2048")
            assert f["--kv-cache-memory-gb"] == "0.5"
            assert f["--kv-cache-tokens"] == ("64" if s.role == "decode" else "4096")
    assert flags(specs["kvstore-0"].args)["--memory-gb"] == "2"
    assert flags(specs["scheduler"].args)["--max-num-requests"] == "7"
    assert flags(specs["scheduler"].args)["--strategy"] == "other"
    assert flags(specs["gateway"].args)["--host"] == "0.0.0.0"
    assert flags(specs["gateway"].args)["--default-max-tokens"] == "256"


def test_no_parent_pid_when_zero() -> None:
    rt = Runtime(nats_url="nats://nats:4222", dist_init="tcp://kvstore:29500", port=8000)
    assert all("--parent-pid" not in s.args for s in build_plan(StackConfig(), rt))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill": 0},
        {"decode": -1},
        {"prefill": 1.5},
        {"dtype": "int8"},
        {"model": ""},
        {"port": 70000},
        {"nats_port": 0},
        {"strategy": "a b"},
        {"kv_cache_tokens": 0},
        {"decode_kv_cache_tokens": -5},
        {"max_model_len": 0},
        {"kv_cache_memory_gb": 0.0},
        {"kvstore_memory_gb": -1.0},
        {"ready_timeout": 0},
        {"log_level": "LOUD"},
        {"extra_args": {"router": ("--x", "1")}},
        {"extra_args": {"gateway": "--x"}},
    ],
)
def test_bad_config_raises(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StackConfig(**kwargs)


def test_bad_runtime_port() -> None:
    with pytest.raises(ValueError):
        Runtime(nats_url="nats://x:1", dist_init="tcp://x:2", port=0)


def test_decode_tp_takes_consecutive_ranks_and_grows_the_world():
    config = StackConfig(prefill=1, decode=2, decode_tp=2, port=8000)
    specs = {s.name: s for s in build_plan(config, RT, python="py")}
    assert config.world_size == 6
    assert [n for n in specs if n.startswith("decode")] == ["decode-0", "decode-0-tp1", "decode-1", "decode-1-tp1"]
    assert config.instance_ids() == ["kvstore-0", "prefill-0", "decode-0", "decode-1"]
    lead, follower = flags(specs["decode-1"].args), flags(specs["decode-1-tp1"].args)
    assert (lead["--rank"], lead["--tp-size"], lead["--world-size"]) == ("4", "2", "6")
    assert specs["decode-1-tp1"].module == "spindle_decode.tp_follower"
    assert (follower["--rank"], follower["--leader-rank"], follower["--tp-size"]) == ("5", "4", "2")
    assert "--nats-url" not in follower
    assert "--tp-size" not in flags(build_plan(StackConfig(), RT)[4].args)


def test_decode_tp_is_checked_against_the_models_kv_heads():
    with pytest.raises(ValueError, match="decode_tp"):
        StackConfig(decode_tp=0)
    check_decode_tp(StackConfig(decode_tp=3))
    with pytest.raises(ValueError, match="exceeds the 3 KV heads"):
        check_decode_tp(StackConfig(decode_tp=4))


def test_elastic_plan_is_one_colocated_engine_per_instance() -> None:
    config = StackConfig(prefill=0, decode=0, elastic=2, strategy="chunked")
    specs = build_plan(config, RT, python="/py")
    assert [s.name for s in specs] == ["kvstore-0", "scheduler", "elastic-0", "elastic-1", "gateway"]
    workers = {s.name: flags(s.args) for s in specs if s.role in ("kvstore", "elastic")}
    assert {n: int(f["--rank"]) for n, f in workers.items()} == {"kvstore-0": 0, "elastic-0": 1, "elastic-1": 2}
    assert all(f["--world-size"] == "3" for f in workers.values())
    assert workers["elastic-0"]["--max-num-batched-tokens"] == "2048" == str(config.chunk_tokens)
    assert flags(specs[1].args)["--strategy"] == "chunked:chunk_size=2048"  # the scheduler's chunks = the budget
    assert config.instance_ids() == ["kvstore-0", "elastic-0", "elastic-1"]
    sized = StackConfig(prefill=0, decode=0, elastic=1, strategy="chunked:chunk_size=300")
    specs = build_plan(sized, RT, python="/py")
    assert flags(specs[2].args)["--max-num-batched-tokens"] == "300"
    assert flags(specs[1].args)["--strategy"] == "chunked:chunk_size=300"
    assert "--shared-chunk" not in flags(specs[2].args)  # the instance's own default
    shared = StackConfig(prefill=0, decode=0, elastic=1, strategy="chunked", shared_chunk=0)
    assert flags(build_plan(shared, RT, python="/py")[2].args)["--shared-chunk"] == "0"
    assert "--partial-kv" not in specs[2].args  # chunked keeps each request whole on one instance
    loong = StackConfig(prefill=0, decode=0, elastic=3, strategy="loongserve", profile="p.json")
    assert all("--partial-kv" in s.args for s in build_plan(loong, RT, python="/py") if s.role == "elastic")


def test_a_pipeline_parallel_elastic_instance_takes_consecutive_ranks_for_its_stages() -> None:
    config = StackConfig(prefill=0, decode=0, elastic=2, elastic_spp=3, strategy="medha", profile="p.json")
    specs = {s.name: s for s in build_plan(config, RT, python="py")}
    assert config.world_size == 7
    names = [n for n in specs if n.startswith("elastic")]
    assert names == ["elastic-0", "elastic-0-spp1", "elastic-0-spp2", "elastic-1", "elastic-1-spp1", "elastic-1-spp2"]
    assert config.instance_ids() == ["kvstore-0", "elastic-0", "elastic-1"]  # the stages register nothing
    assert "--partial-kv" in specs["elastic-1"].args  # pipelines of a KV-parallel group hold parts (Medha's 3D)
    lead = flags(tuple(a for a in specs["elastic-1"].args if a != "--partial-kv"))
    stage = flags(specs["elastic-1-spp2"].args)
    assert (lead["--rank"], lead["--spp-size"], lead["--world-size"]) == ("4", "3", "7")
    assert specs["elastic-1-spp2"].module == "spindle_elastic.spp_stage"
    assert (stage["--rank"], stage["--leader-rank"], stage["--spp-size"]) == ("6", "4", "3")
    assert "--nats-url" not in stage and stage["--model"] == lead["--model"]
    twod = StackConfig(prefill=0, decode=0, elastic=1, elastic_spp=2, elastic_tp=2, strategy="chunked")
    specs = {s.name: s for s in build_plan(twod, RT, python="py")}
    assert twod.world_size == 5 and [n for n in specs if n.startswith("elastic-0-")] == [
        "elastic-0-spp1", "elastic-0-spp2", "elastic-0-spp3"
    ]  # fmt: skip
    assert flags(specs["elastic-0"].args)["--tp-size"] == "2" == flags(specs["elastic-0-spp3"].args)["--tp-size"]
    assert flags(specs["elastic-0-spp3"].args)["--rank"] == "4"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"elastic": 1, "strategy": "chunked"}, "serve alone"),  # prefill 2 / decode 1 by default
        ({"prefill": 0, "decode": 0, "elastic": 1}, "onto the same instances"),
        ({"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked", "decode_kvp": 2}, "not elastic"),
        ({"prefill": 0, "decode": 0, "elastic": -1, "strategy": "chunked"}, "non-negative"),
        ({"prefill": 0, "decode": 0}, "or elastic > 0"),
        ({"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked", "shared_chunk": -1}, "shared_chunk"),
        ({"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked", "elastic_spp": 0}, "elastic_spp"),
        ({"elastic_spp": 2}, "applies to elastic instances"),
        ({"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked", "elastic_tp": 2}, "set elastic_spp > 1"),
        (
            {
                "prefill": 0,
                "decode": 0,
                "elastic": 1,
                "elastic_spp": 2,
                "strategy": "medha:spp_overlap=1",
                "profile": "p.json",
            },
            "samples asynchronously",
        ),
        (
            {"prefill": 0, "decode": 0, "elastic": 2, "strategy": "loongserve", "profile": "p.json", "elastic_spp": 2},
            "moves KV between elastic instances",
        ),
        (
            {
                "prefill": 0,
                "decode": 0,
                "elastic": 2,
                "strategy": "medha",
                "profile": "p.json",
                "elastic_spp": 2,
                "elastic_tp": 2,
            },
            "add kvp=1",
        ),
    ],
)
def test_bad_elastic_config_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StackConfig(**kwargs)


@pytest.mark.parametrize(
    "argv, cpus, want",
    [
        ([], 2, {"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked"}),
        ([], 7, {"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked"}),
        ([], 8, {"prefill": 2, "decode": 1, "elastic": 0, "strategy": "single"}),
        (["--prefill", "1"], 2, {"prefill": 1, "decode": 1, "elastic": 0, "strategy": "single"}),
        (["--decode", "2"], 2, {"prefill": 2, "decode": 2, "elastic": 0, "strategy": "single"}),
        (["--elastic", "2"], 64, {"prefill": 0, "decode": 0, "elastic": 2, "strategy": "chunked"}),
        (["--elastic", "1", "--chunk-size", "512"], 2, {"prefill": 0, "decode": 0, "elastic": 1,
                                                         "strategy": "chunked:chunk_size=512"}),
        (["--shared-chunk-size", "0"], 2, {"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked",
                                           "shared_chunk": 0}),
        (["--strategy", "fixed-sp:sp=2"], 16, {"prefill": 2, "decode": 1, "elastic": 0, "strategy": "fixed-sp:sp=2"}),
        # a strategy that plans onto prefill and decode instances: their layout on any machine
        (["--strategy", "tetris"], 2, {"prefill": 2, "decode": 1, "elastic": 0, "strategy": "tetris"}),
        (["--strategy", "request-sp:max_sp=2"], 7, {"prefill": 2, "decode": 1, "elastic": 0,
                                                     "strategy": "request-sp:max_sp=2"}),
        (["--strategy", "chunked"], 2, {"prefill": 0, "decode": 0, "elastic": 1, "strategy": "chunked"}),
        # a per-iteration strategy of elastic instances: elastic instances on any machine
        (["--strategy", "loongserve:max_dop=1"], 16, {"prefill": 0, "decode": 0, "elastic": 3,
                                                      "strategy": "loongserve:max_dop=1"}),
        (["--elastic", "2", "--strategy", "loongserve"], 2, {"prefill": 0, "decode": 0, "elastic": 2,
                                                             "strategy": "loongserve"}),
    ],
)  # fmt: skip
def test_spindle_up_layout_follows_the_machine_unless_named(argv: list[str], cpus: int, want: dict) -> None:
    from spindle_launcher.cli import build_parser, layout_from_args

    assert layout_from_args(build_parser().parse_args(["up", *argv]), cpu_count=cpus) == want


def test_chunk_size_needs_elastic_instances() -> None:
    from spindle_launcher.cli import build_parser, layout_from_args

    for flag in ("--chunk-size", "--shared-chunk-size"):
        with pytest.raises(ValueError, match="elastic"):
            layout_from_args(build_parser().parse_args(["up", flag, "64"]), cpu_count=16)


def test_prefill_instances_report_virtual_nodes() -> None:
    specs = {s.name: s for s in build_plan(StackConfig(prefill=5, prefill_per_node=2), RT)}
    nodes = [specs[f"prefill-{i}"].args[specs[f"prefill-{i}"].args.index("--node") + 1] for i in range(5)]
    assert nodes == ["node-0", "node-0", "node-1", "node-1", "node-2"]
    assert "--node" not in specs["decode-0"].args and "--node" not in build_plan(StackConfig(), RT)[2].args
    with pytest.raises(ValueError, match="prefill_per_node"):
        StackConfig(prefill_per_node=-1)


def test_a_strategy_the_services_cannot_run_yet_is_refused_with_why(monkeypatch) -> None:
    from spindle_policy import strategy as registry

    class Gap(registry.strategy_class("single")):  # every registered strategy runs on the services today
        real_stack_gap = "its mechanism is not built yet"

    monkeypatch.setitem(registry._REGISTRY, "gap-test", Gap)
    with pytest.raises(ValueError, match=r"runs in `spindle sim` only for now: its mechanism is not built yet"):
        StackConfig(strategy="gap-test")


def test_seesaw_runs_re_sharding_groups_of_its_plan() -> None:
    from spindle_launcher.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["up", "--strategy", "seesaw", "--host-kv-tokens", "900"]))
    assert (config.elastic, config.elastic_reshard, config.host_kv_tokens, config.world_size) == (1, "PP2:TP2", 900, 3)
    specs = {s.name: s for s in build_plan(config, RT, python="py")}
    assert [n for n in specs if n.startswith("elastic")] == ["elastic-0", "elastic-0-member1"]
    lead, member = flags(specs["elastic-0"].args), flags(specs["elastic-0-member1"].args)
    assert (lead["--reshard"], lead["--host-kv-tokens"], lead["--rank"]) == ("PP2:TP2", "900", "1")
    assert specs["elastic-0-member1"].module == "spindle_elastic.reshard_member"
    assert (member["--rank"], member["--leader-rank"], member["--reshard-size"]) == ("2", "1", "2")
    assert "--max-num-batched-tokens" not in lead and "--partial-kv" not in specs["elastic-0"].args
    three = StackConfig(prefill=0, decode=0, elastic=2, strategy="seesaw", elastic_reshard="PP3:TP3")
    assert three.world_size == 7 and len([s for s in build_plan(three, RT) if s.role == "elastic.reshard_member"]) == 4
    for kwargs, match in [
        ({"strategy": "seesaw"}, "set elastic_reshard"),
        ({"strategy": "chunked", "elastic_reshard": "PP2:TP2"}, "set elastic_reshard"),
        ({"strategy": "seesaw", "elastic_reshard": "PP2:TP4"}, "same number of processes"),
        ({"strategy": "seesaw", "elastic_reshard": "PP2:TP2", "elastic_spp": 2}, "elastic_spp 1"),
        ({"strategy": "seesaw:schedule=chunked", "elastic_reshard": "PP2:TP2"}, "transition schedule only"),
        ({"strategy": "chunked", "host_kv_tokens": 5}, "host_kv_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            StackConfig(prefill=0, decode=0, elastic=1, **kwargs)


def test_a_mesh_data_plane_runs_its_rendezvous_first_and_instances_restart_as_units() -> None:
    rt = Runtime(nats_url="nats://127.0.0.1:4333", dist_init="mesh://127.0.0.1:29777", port=8123)
    specs = build_plan(StackConfig(prefill=1, decode=1, decode_tp=2, elastic=0), rt, python="/py")
    first = specs[0]
    assert first.name == "rendezvous" and first.role == "rendezvous"
    assert first.argv == ("/py", "-m", "spindle_transfer.rendezvous", "--host", "127.0.0.1", "--port", "29777")
    assert all(flags(s.args)["--dist-init"] == "mesh://127.0.0.1:29777" for s in specs if "--dist-init" in s.args)
    units = {s.name: s.unit_name for s in specs}
    assert units["decode-0-tp1"] == "decode-0" and units["decode-0"] == "decode-0" and units["prefill-0"] == "prefill-0"
    assert "rendezvous" not in {s.name for s in build_plan(StackConfig(), RT)}  # tcp://: rank 0 hosts the store
