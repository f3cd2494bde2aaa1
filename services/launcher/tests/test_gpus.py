"""`spindle up --device cuda --gpus ...`: the rank -> GPU map (pure), its checks, and the flags the plan passes."""

from __future__ import annotations

import os

import pytest

from spindle_launcher.cli import build_parser, config_from_args
from spindle_launcher.gpus import (
    check_visible,
    gpu_map,
    kv_memory_fraction,
    parse_gpus,
    rank_devices,
    sharers,
)
from spindle_launcher.plan import Runtime, StackConfig, added_instance, build_plan, plan_ranks
from spindle_launcher.stack import StackError, check_cuda

RT = Runtime(nats_url="nats://127.0.0.1:4333", dist_init="mesh://127.0.0.1:29777", port=8123, parent_pid=4242)


def flag(args: tuple[str, ...], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize(
    "text, want",
    [("0", (0,)), ("0,1", (0, 1)), (" 3, 1 ,2", (3, 1, 2)), ("7", (7,)), ("0,1,2,3,4,5,6,7", tuple(range(8)))],
)
def test_parse_gpus(text: str, want: tuple[int, ...]) -> None:
    assert parse_gpus(text) == want


@pytest.mark.parametrize(
    "text, why",
    [("", "separated by commas"), ("0,", "separated by commas"), ("0,,1", "separated by commas"),
     ("a", "integer"), ("1.5", "integer"), ("-1", "0..1023"), ("0,-2", "0..1023"), ("1024", "0..1023"),
     ("0,1,0", "distinct")],
)  # fmt: skip
def test_parse_gpus_refuses(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_gpus(text)


def test_ranks_take_the_gpus_round_robin_and_the_kvstore_stays_on_the_cpu() -> None:
    assert rank_devices(4, "cpu", ()) == {0: "cpu", 1: "cpu", 2: "cpu", 3: "cpu"}
    assert rank_devices(6, "cuda", (0, 1)) == {0: "cpu", 1: "cuda:0", 2: "cuda:1", 3: "cuda:0", 4: "cuda:1",
                                               5: "cuda:0"}  # fmt: skip
    assert rank_devices(4, "cuda", (5, 2, 7)) == {0: "cpu", 1: "cuda:5", 2: "cuda:2", 3: "cuda:7"}
    one = rank_devices(5, "cuda", (0,))  # the one-GPU machine: every engine process on it
    assert set(one.values()) == {"cpu", "cuda:0"} and sharers(one) == {0: 1, 1: 4, 2: 4, 3: 4, 4: 4}
    assert kv_memory_fraction(one, 1) == 0.125 and kv_memory_fraction(rank_devices(3, "cuda", (0, 1)), 2) == 0.5
    assert rank_devices(6, "cuda", (0, 1)) == rank_devices(6, "cuda", (0, 1))  # deterministic


@pytest.mark.parametrize(
    "args, why",
    [((4, "cpu", (0,)), "apply with device cuda"), ((4, "cuda", ()), "at least one GPU"),
     ((4, "rocm", (0,)), "device must be"), ((0, "cpu", ()), "world_size"), ((4, "cuda", (1, 1)), "distinct")],
)  # fmt: skip
def test_rank_devices_refuses(args: tuple, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        rank_devices(*args)


def test_a_groups_members_get_gpus_of_their_own_when_there_are_enough() -> None:
    config = StackConfig(prefill=1, decode=1, decode_tp=3, device="cuda", gpus=(0, 1, 2, 3))
    devices = {s.name: flag(s.args, "--device") for s in build_plan(config, RT) if "--rank" in s.args}
    assert devices == {"kvstore-0": None, "prefill-0": "cuda:0", "decode-0": "cuda:1", "decode-0-tp1": "cuda:2",
                       "decode-0-tp2": "cuda:3"}  # fmt: skip
    spp = StackConfig(prefill=0, decode=0, elastic=2, elastic_spp=2, strategy="chunked", device="cuda", gpus=(0, 1))
    devices = {s.name: flag(s.args, "--device") for s in build_plan(spp, RT) if s.name.startswith("elastic")}
    assert devices == {"elastic-0": "cuda:0", "elastic-0-spp1": "cuda:1", "elastic-1": "cuda:0",
                       "elastic-1-spp1": "cuda:1"}  # fmt: skip


def test_a_cuda_plan_passes_devices_and_splits_kv_memory_between_sharers() -> None:
    specs = build_plan(StackConfig(prefill=2, decode=1, decode_kvp=2, device="cuda"), RT)
    engines = [s for s in specs if flag(s.args, "--model") and s.role != "scheduler" and s.role != "gateway"]
    assert [s.name for s in engines] == ["prefill-0", "prefill-1", "decode-0", "decode-0-kvp1"]
    assert {flag(s.args, "--device") for s in engines} == {"cuda:0"}  # --gpus left out: GPU 0
    assert {flag(s.args, "--kv-memory-fraction") for s in engines} == {"0.125"}  # four processes on it
    assert "--device" not in next(s for s in specs if s.name == "kvstore-0").args
    sized = build_plan(StackConfig(device="cuda", gpus=(0, 1), kv_cache_memory_gb=4.0), RT)
    assert all("--kv-memory-fraction" not in s.args for s in sized)  # a size given is a size used
    tokens = build_plan(StackConfig(device="cuda", kv_cache_tokens=8192), RT)
    assert all("--kv-memory-fraction" not in s.args for s in tokens)


def test_a_cpu_plan_is_unchanged() -> None:
    for config in (StackConfig(), StackConfig(prefill=1, decode=2, decode_tp=2), StackConfig(device="cpu")):
        assert all("--device" not in s.args and "--kv-memory-fraction" not in s.args for s in build_plan(config, RT))


def test_an_added_instance_gets_the_gpu_its_rank_maps_to() -> None:
    config = StackConfig(prefill=2, decode=1, device="cuda", gpus=(0, 1))  # ranks 1-3: cuda:0, cuda:1, cuda:0
    specs = {s.name: s for s in build_plan(config, RT)}
    for role in ("prefill", "decode"):
        template = specs[f"{role}-0"]
        added = [added_instance(config, template, f"{role}-{9 + i}", rank) for i, rank in enumerate((4, 5, 6))]
        assert [flag(s.args, "--device") for s in added] == ["cuda:1", "cuda:0", "cuda:1"]
        assert [flag(s.args, "--device") for s in added] == [config.rank_devices(7)[r] for r in (4, 5, 6)]
        # rank 4 shares cuda:1 with rank 2; rank 5 shares cuda:0 with ranks 1 and 3; rank 6 is cuda:1's third
        assert [flag(s.args, "--kv-memory-fraction") for s in added] == ["0.25", "0.166667", "0.166667"]
        assert [(flag(s.args, "--instance-id"), flag(s.args, "--rank")) for s in added] == [
            (f"{role}-9", "4"), (f"{role}-10", "5"), (f"{role}-11", "6")]  # fmt: skip
        for spec in added:  # otherwise the template's command, flag for flag
            assert len(spec.argv) == len(template.argv) and spec.name == flag(spec.args, "--instance-id")
            differ = {template.argv[i - 1] for i, a in enumerate(spec.argv) if a != template.argv[i]}
            assert differ <= {"--instance-id", "--rank", "--device", "--kv-memory-fraction"}
    sized = StackConfig(prefill=2, decode=1, device="cuda", gpus=(0, 1), kv_cache_tokens=4096)
    spec = added_instance(sized, next(s for s in build_plan(sized, RT) if s.name == "prefill-0"), "prefill-2", 4)
    assert flag(spec.args, "--device") == "cuda:1" and "--kv-memory-fraction" not in spec.args
    one = StackConfig(prefill=1, decode=1, device="cuda")  # --gpus left out: GPU 0, for added ranks too
    spec = added_instance(one, next(s for s in build_plan(one, RT) if s.name == "decode-0"), "decode-1", 3)
    assert flag(spec.args, "--device") == "cuda:0" and flag(spec.args, "--kv-memory-fraction") == "0.166667"


def test_an_instance_added_to_a_cpu_stack_passes_no_device() -> None:
    config = StackConfig(prefill=2, decode=1)
    template = next(s for s in build_plan(config, RT) if s.name == "prefill-0")
    spec = added_instance(config, template, "prefill-2", 4)
    assert "--device" not in spec.args and "--kv-memory-fraction" not in spec.args
    assert spec.argv == tuple("prefill-2" if a == "prefill-0" else "4" if a == "1" else a for a in template.argv)


def test_the_gpu_map_in_words() -> None:
    config = StackConfig(prefill=2, decode=1, device="cuda", gpus=(0, 1))
    lines = gpu_map(config.rank_devices(), plan_ranks(build_plan(config, RT)))
    assert lines == [
        "cuda:0: prefill-0 (rank 1), decode-0 (rank 3); 2 processes share it, host-staged between them",
        "cuda:1: prefill-1 (rank 2)",
    ]
    assert gpu_map(StackConfig().rank_devices(), plan_ranks(build_plan(StackConfig(), RT))) == []


@pytest.mark.parametrize(
    "argv, why",
    [(["--gpus", "0,1"], "add --device cuda"), (["--device", "cuda", "--gpus", "0,0"], "distinct"),
     (["--device", "cuda", "--gpus", "x"], "integer")],
)  # fmt: skip
def test_spindle_up_flags(argv: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        config_from_args(build_parser().parse_args(["up", *argv]))


def test_spindle_up_flags_reach_the_config() -> None:
    config = config_from_args(build_parser().parse_args(["up", "--device", "cuda", "--gpus", "1,0"]))
    assert (config.device, config.gpus) == ("cuda", (1, 0))
    config = config_from_args(build_parser().parse_args(["up"]))
    assert (config.device, config.gpus) == ("cpu", ())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--device", "tpu"])


def test_the_gpus_must_exist_at_start() -> None:
    check_visible((0, 1), 2)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_visible((0,), 0)
    with pytest.raises(ValueError, match=r"GPU ids \[2, 5\] do not exist: torch sees 2 GPU\(s\) here, ids 0..1"):
        check_visible((2, 0, 5), 2)


def test_spindle_up_asks_torch_for_the_gpus_before_starting() -> None:
    check_cuda(StackConfig(), dict(os.environ))  # a CPU stack asks nothing
    with pytest.raises(StackError, match=r"no CUDA device|do not exist"):
        check_cuda(StackConfig(device="cuda", gpus=(1023,)), dict(os.environ))  # no machine has GPU 1023
