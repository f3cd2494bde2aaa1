"""The pure part of `spindle up`: a validated stack configuration -> the command of every service.

Ranks of the data-plane group: kvstore 0, prefill 1..N, then decode instance i at N+1+i*T..N+(i+1)*T (T =
`decode_tp`: the leader `spindle_decode`, then T-1 `spindle_decode.tp_follower` processes named decode-i-tpJ;
or T = `decode_kvp`: the leader, then T-1 `spindle_decode.kvp_follower` members named decode-i-kvpJ), then the
elastic (colocated) instances elastic-0.. (E of them, each of S = `elastic_spp` x `elastic_tp` ranks: the leader
`spindle_elastic`, then S-1 `spindle_elastic.spp_stage` processes named elastic-i-sppJ, J the rank's offset in the
instance); world size N+M*T+E*S+1. With `device="cuda"` every rank but the kvstore's runs on a GPU (gpus.py).
deploy/docker-compose.yml describes the same commands; tests/test_deploy.py keeps the two in step.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from urllib.parse import urlparse

from spindle_policy.strategy import stack_traits
from spindle_protocol.service import STACK_TOKEN_ENV

from .gpus import DEVICES, check_gpus, kv_memory_fraction, rank_devices
from .restarts import DEFAULT_RESTART, RestartPolicy

DTYPES = ("float32", "bfloat16", "float16")
ROLES = ("kvstore", "scheduler", "prefill", "decode", "elastic", "gateway")
COLOCATED_STRATEGY = "chunked"  # the strategy that plans onto elastic instances by default


DEFAULT_CHUNK_TOKENS = 2048  # an elastic instance's per-step token budget (the prefill chunk size; vLLM-CPU's too)
DISAGGREGATE_MIN_CORES = 8  # `spindle up`'s default layout: disaggregated from this many cores, else colocated
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_STRATEGY_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}(:[A-Za-z0-9_.,=-]{1,200})?$")  # NAME or NAME:key=value,...


def _port(value: int, what: str, allow_zero: bool) -> None:
    if not isinstance(value, int) or not (0 if allow_zero else 1) <= value <= 65535:
        raise ValueError(f"{what} must be a port number in {'0' if allow_zero else '1'}..65535, got {value!r}")


def _positive(value: float | None, what: str) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{what} must be positive, got {value!r}")


@dataclass(frozen=True)
class StackConfig:
    """What `spindle up` starts. None means "the service's own default" (the flag is not passed)."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"  # where the engines run: "cpu" or "cuda" (each rank on a GPU of `gpus`, gpus.py)
    gpus: tuple[int, ...] = ()  # with device "cuda": the GPU ids ranks take round-robin (() = GPU 0 alone)
    prefill: int = 2  # prefill instances
    decode: int = 1  # decode instances
    elastic: int = 0  # elastic (colocated) instances: prefill and decode in one engine; then prefill = decode = 0
    shared_chunk: int | None = None  # elastic: one prompt's tokens per step while others share the instance
    elastic_spp: int = 1  # sequence-pipeline stages of each elastic instance
    elastic_tp: int = 1  # tensor-parallel ranks inside each stage of a pipeline elastic instance (elastic_spp > 1)
    # each elastic instance a re-sharding group (seesaw) of this plan, PREFILL:DECODE (e.g. PP2:TP2); "" = none
    elastic_reshard: str = ""
    host_kv_tokens: int | None = None  # a re-sharding group's host KV tier in tokens (None: the instance's default)
    decode_tp: int = 1  # tensor-parallel ranks (processes) of each decode instance
    decode_kvp: int = 1  # KV-parallel members (processes) of each decode instance (with decode_tp 1)
    # > 0: prefill instances report nodes "node-0", "node-1", ... of this many instances each (strategies keep SP
    # groups inside a node: Tetris's GetGroup); 0: every instance reports the host name
    prefill_per_node: int = 0
    kvp_tokens: int = 0  # per-member KV token limit of a new request on a KVP group (the strategy's kvp_tokens)
    kvp_scale_down_tokens: int = 0  # KVP ranges shorter than this merge into a neighbour with room; 0 = never
    host: str = "127.0.0.1"  # gateway bind address
    port: int = 8000  # gateway port; 0 = a free port chosen at start
    nats_port: int | None = None  # None = a free port
    strategy: str = "single"
    profile: str | None = None  # latency profile JSON for strategies that predict (fixed-sp, request-sp)
    kv_cache_tokens: int | None = None
    kv_cache_memory_gb: float | None = None
    decode_kv_cache_tokens: int | None = None  # overrides kv_cache_tokens on decode instances
    max_model_len: int | None = None
    default_max_tokens: int | None = None  # the gateway's default max_tokens of chat requests
    batch_db: str | None = None  # the gateway's Batch API store (None: its default, per port; "off": none)
    kvstore_memory_gb: float | None = None
    otlp_endpoint: str | None = None
    log_level: str = "INFO"
    ready_timeout: float = 180.0  # seconds
    log_dir: str | None = None  # child output to LOG_DIR/NAME.log instead of the launcher's stderr
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # role -> more flags (tests, tuning)
    spare_ranks: int = 8  # data-plane ranks kept free for instances added at run time (`spindle add`; mesh only)
    restart: RestartPolicy | None = DEFAULT_RESTART  # restart dead processes (None: stop the stack on any death)
    env: dict[str, str] = field(default_factory=dict)  # added to every child's environment

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not isinstance(self.gpus, tuple):
            raise ValueError(f"gpus must be a tuple of GPU ids, got {self.gpus!r}")
        if self.gpus and self.device != "cuda":
            raise ValueError("gpus (--gpus) name the GPUs of device cuda: add --device cuda")
        check_gpus(self.gpus)
        if self.shared_chunk is not None and (not isinstance(self.shared_chunk, int) or self.shared_chunk < 0):
            raise ValueError(f"shared_chunk must be a non-negative integer, got {self.shared_chunk!r}")
        if not isinstance(self.elastic, int) or self.elastic < 0:
            raise ValueError(f"elastic must be a non-negative integer, got {self.elastic!r}")
        traits = stack_traits(self.strategy)
        if gap := traits.stack_gap:
            raise ValueError(f"strategy {self.strategy!r} runs in `spindle sim` only for now: {gap}")
        if self.profile is None and traits.needs_latency:
            raise ValueError(
                f"strategy {self.strategy!r} plans with predicted times: pass --profile (a latency profile from "
                "`spindle profile`, with the SP sizes it plans for)"
            )
        if self.elastic:
            if self.prefill or self.decode:
                raise ValueError(
                    "elastic instances serve alone: set prefill = decode = 0 with elastic > 0 (a pool mixing "
                    "elastic with prefill/decode instances needs a strategy that plans over both)"
                )
            if not traits.colocated:
                raise ValueError(
                    "elastic instances run a strategy that plans prefill and decode onto the same instances "
                    f"(chunked, loongserve, medha), got strategy {self.strategy!r}"
                )
            if self.decode_tp > 1 or self.decode_kvp > 1 or self.kvp_tokens or self.kvp_scale_down_tokens:
                raise ValueError("decode_tp, decode_kvp and the kvp options apply to decode instances, not elastic")
            if self.elastic_spp > 1 and not traits.keeps_kv_in_place:
                raise ValueError(
                    f"strategy {self.strategy!r} moves KV between elastic instances, which a pipeline-parallel "
                    "instance does not do yet: use elastic_spp 1, or the chunked or medha strategy"
                )
            if self.elastic_tp > 1 and self.elastic > 1 and traits.spreads_kv:
                raise ValueError(
                    f"strategy {self.strategy!r} may spread a request's KV over several elastic instances (KV "
                    "parallelism), which pipelines with TP inside their stages do not do: add kvp=1 to its options "
                    "(e.g. medha:kvp=1), use elastic_tp 1, or run one elastic instance"
                )
        else:
            for what, n in (("prefill", self.prefill), ("decode", self.decode)):
                if not isinstance(n, int) or n < 1:
                    raise ValueError(f"need at least one {what} instance (or elastic > 0), got {n!r}")
        if not isinstance(self.elastic_spp, int) or self.elastic_spp < 1:
            raise ValueError(f"elastic_spp must be a positive integer, got {self.elastic_spp!r}")
        if self.elastic_spp > 1 and not self.elastic:
            raise ValueError("elastic_spp applies to elastic instances: set elastic > 0 too")
        if traits.reshards != bool(self.elastic_reshard):
            raise ValueError(
                "a re-sharding strategy (seesaw) runs on re-sharding groups and they run only it: set elastic_reshard "
                f"(e.g. PP2:TP2) with it, got strategy {self.strategy!r} and elastic_reshard {self.elastic_reshard!r}"
            )
        if self.elastic_reshard:
            from spindle_engine.reshard import ReshardPlan

            ReshardPlan.parse(self.elastic_reshard)  # ValueError says what is wrong
            if self.elastic_spp > 1 or self.elastic_tp > 1:
                raise ValueError("elastic_reshard names the group's configurations: leave elastic_spp, elastic_tp 1")
        if self.host_kv_tokens is not None and (not self.elastic_reshard or self.host_kv_tokens < 1):
            raise ValueError("host_kv_tokens is a positive size of a re-sharding group's tier (elastic_reshard)")
        if not isinstance(self.elastic_tp, int) or self.elastic_tp < 1:
            raise ValueError(f"elastic_tp must be a positive integer, got {self.elastic_tp!r}")
        if self.elastic_tp > 1 and self.elastic_spp == 1:
            raise ValueError("elastic_tp is TP inside the stages of a pipeline elastic instance: set elastic_spp > 1")
        if not isinstance(self.prefill_per_node, int) or self.prefill_per_node < 0:
            raise ValueError(f"prefill_per_node must be a non-negative integer, got {self.prefill_per_node!r}")
        if not isinstance(self.decode_tp, int) or self.decode_tp < 1:
            raise ValueError(f"decode_tp must be a positive integer, got {self.decode_tp!r}")
        if not isinstance(self.decode_kvp, int) or self.decode_kvp < 1:
            raise ValueError(f"decode_kvp must be a positive integer, got {self.decode_kvp!r}")
        if self.decode_kvp > 1 and self.decode_tp > 1:
            raise ValueError(
                "decode_kvp > 1 needs decode_tp 1: KV-parallel members with tensor parallelism are not supported"
            )
        if not isinstance(self.kvp_tokens, int) or self.kvp_tokens < 0:
            raise ValueError(f"kvp_tokens must be a non-negative integer, got {self.kvp_tokens!r}")
        if self.kvp_tokens and self.decode_kvp == 1:
            raise ValueError("kvp_tokens applies to KV-parallel decode instances: set decode_kvp > 1 too")
        if not isinstance(self.kvp_scale_down_tokens, int) or self.kvp_scale_down_tokens < 0:
            raise ValueError(
                f"kvp_scale_down_tokens must be a non-negative integer, got {self.kvp_scale_down_tokens!r}"
            )
        if self.kvp_scale_down_tokens and self.decode_kvp == 1:
            raise ValueError("kvp_scale_down_tokens applies to KV-parallel decode instances: set decode_kvp > 1 too")
        if not self.host:
            raise ValueError("host must be non-empty")
        _port(self.port, "port", allow_zero=True)
        if self.nats_port is not None:
            _port(self.nats_port, "nats_port", allow_zero=False)
        if not _STRATEGY_RE.match(self.strategy):
            raise ValueError(f"strategy must be NAME or NAME:key=value,... (e.g. fixed-sp:sp=2), got {self.strategy!r}")
        for what in ("kv_cache_tokens", "decode_kv_cache_tokens", "max_model_len", "default_max_tokens"):
            value = getattr(self, what)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{what} must be a positive integer, got {value!r}")
        if self.spare_ranks < 0:
            raise ValueError(f"spare_ranks must be >= 0, got {self.spare_ranks}")
        for what in ("kv_cache_memory_gb", "kvstore_memory_gb", "ready_timeout"):
            _positive(getattr(self, what), what)
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for role, args in self.extra_args.items():
            if role not in ROLES:
                raise ValueError(f"extra_args: unknown role {role!r} (one of {', '.join(ROLES)})")
            if not isinstance(args, tuple | list) or not all(isinstance(a, str) for a in args):
                raise ValueError(f"extra_args[{role!r}] must be a sequence of strings")

    @property
    def decode_ranks(self) -> int:
        """Processes (ranks) of one decode instance: its TP ranks or its KVP members."""
        return self.decode_tp * self.decode_kvp

    @property
    def world_size(self) -> int:
        return self.prefill + self.decode * self.decode_ranks + self.elastic * self.elastic_ranks + 1

    @property
    def elastic_ranks(self) -> int:
        """Processes (ranks) of one elastic instance: its pipeline stages' TP ranks, or its re-sharding group's."""
        if self.elastic_reshard:
            from spindle_engine.reshard import ReshardPlan

            return ReshardPlan.parse(self.elastic_reshard).world
        return self.elastic_spp * self.elastic_tp

    @property
    def chunk_tokens(self) -> int:
        """An elastic instance's per-step token budget: the strategy's chunk_size, else DEFAULT_CHUNK_TOKENS."""
        found = re.search(r"(?:^|[:,])chunk[_-]size=(\d+)(?:,|$)", self.strategy)
        return int(found.group(1)) if found else DEFAULT_CHUNK_TOKENS

    def rank_devices(self, ranks: int | None = None) -> dict[int, str]:
        """rank -> "cpu" or "cuda:N" for every rank of the plan, or for ranks 0..ranks-1 (gpus.rank_devices: ranks
        added at run time, past the plan's, continue its rule)."""
        world = self.world_size if ranks is None else ranks
        return rank_devices(world, self.device, self.gpus or ((0,) if self.device == "cuda" else ()))

    def decode_rank(self, i: int) -> int:
        """The leader rank of decode instance `i`; its followers take the next decode_ranks - 1 ranks."""
        return 1 + self.prefill + i * self.decode_ranks

    def instance_ids(self) -> list[str]:
        """The instances that must appear live in the scheduler's ClusterStatus."""
        ids = ["kvstore-0"]
        ids += [f"prefill-{i}" for i in range(self.prefill)]
        ids += [f"decode-{i}" for i in range(self.decode)]
        ids += [f"elastic-{i}" for i in range(self.elastic)]
        return ids


@dataclass(frozen=True)
class Runtime:
    """Addresses known only once the stack starts (or, in deploy/, fixed by the compose file)."""

    nats_url: str
    dist_init: str  # the data plane's rendezvous: mesh://HOST:PORT (the plan runs it), or tcp://... (rank 0 hosts it)
    port: int  # the gateway's port (StackConfig.port resolved)
    parent_pid: int = 0  # children exit when it dies; 0 = no watch
    stack_token: str = ""  # the gateway returns it on /health (SPINDLE_STACK_TOKEN); "" = none

    def __post_init__(self) -> None:
        _port(self.port, "runtime port", allow_zero=False)


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # process name in the stack: kvstore-0, scheduler, prefill-0, ..., decode-0, gateway
    argv: tuple[str, ...]  # [python, -m, module, flags...]
    env: dict[str, str]  # added to the launcher's environment
    survivable: bool = False  # its exit does not stop the stack (a KVP group goes on without a dead follower)
    unit: str = ""  # what restarts with it: its instance's leader process (default: itself)

    @property
    def unit_name(self) -> str:
        return self.unit or self.name

    @property
    def module(self) -> str:
        return self.argv[2]

    @property
    def args(self) -> tuple[str, ...]:
        return self.argv[3:]

    @property
    def role(self) -> str:
        """prefill, decode, ..., decode.tp_follower, ...; `rendezvous` for the data plane's rendezvous."""
        return self.module.removeprefix("spindle_").removeprefix("transfer.")


def rank_capacity(config: StackConfig, runtime: Runtime) -> int:
    """The data plane's ranks: the plan's, plus `spare_ranks` for instances added at run time on a mesh (a fixed
    tcp:// world has exactly the plan's)."""
    return config.world_size + (config.spare_ranks if runtime.dist_init.startswith("mesh://") else 0)


def plan_ranks(specs: list[ServiceSpec]) -> dict[int, str]:
    """rank -> process name of every service of a plan that holds a data-plane rank."""
    ranks = {}
    for spec in specs:
        if "--rank" in spec.args:
            ranks[int(spec.args[spec.args.index("--rank") + 1])] = spec.name
    return ranks


def added_instance(config: StackConfig, template: ServiceSpec, instance_id: str, rank: int) -> ServiceSpec:
    """A further instance like `template` (a one-process prefill or decode instance of `config`'s plan), with its
    own id and data-plane rank. On a CUDA stack it runs where `build_plan` would put that rank: its GPU by the rule
    of gpus.rank_devices, and (unless the KV size is given) the KV share of that GPU split between the ranks on it
    up to this one; on a CPU stack it passes no device flags, as the plan does not."""
    argv = list(template.argv)
    flags = [("--instance-id", instance_id), ("--rank", str(rank))]
    if config.device != "cpu":
        devices = config.rank_devices(rank + 1)
        flags.append(("--device", devices[rank]))
        if "--kv-memory-fraction" in argv:
            flags.append(("--kv-memory-fraction", _num(kv_memory_fraction(devices, rank))))
    for flag, value in flags:
        argv[argv.index(flag) + 1] = value
    return replace(template, name=instance_id, argv=tuple(argv), unit="")


def build_plan(config: StackConfig, runtime: Runtime, python: str = sys.executable) -> list[ServiceSpec]:
    """Every service of the stack in start order: (rendezvous,) kvstore, scheduler, prefill..., decode..., gateway."""
    world = str(rank_capacity(config, runtime))
    common = ["--nats-url", runtime.nats_url, "--log-level", config.log_level.upper()]
    if runtime.parent_pid:
        common += ["--parent-pid", str(runtime.parent_pid)]
    if config.otlp_endpoint:
        common += ["--otlp-endpoint", config.otlp_endpoint]

    def worker(instance_id: str, rank: int) -> list[str]:
        rank_flags = ["--rank", str(rank), "--world-size", world]
        return ["--instance-id", instance_id, *rank_flags, "--dist-init", runtime.dist_init]

    devices = config.rank_devices()

    def engine(kv_cache_tokens: int | None, rank: int) -> list[str]:
        out = ["--model", config.model, "--dtype", config.dtype]
        if devices[rank] != "cpu":  # a CPU plan passes no device flags (the instances' default)
            out += ["--device", devices[rank]]
        if kv_cache_tokens is not None:
            out += ["--kv-cache-tokens", str(kv_cache_tokens)]
        if config.kv_cache_memory_gb is not None:
            out += ["--kv-cache-memory-gb", _num(config.kv_cache_memory_gb)]
        elif kv_cache_tokens is None and devices[rank] != "cpu":
            out += ["--kv-memory-fraction", _num(kv_memory_fraction(devices, rank))]
        if config.max_model_len is not None:
            out += ["--max-model-len", str(config.max_model_len)]
        return out

    env = {"PYTHONUNBUFFERED": "1", **config.env}
    specs: list[ServiceSpec] = []

    def add(name: str, role: str, flags: list[str], more_env: dict[str, str] | None = None) -> None:
        argv = (python, "-m", f"spindle_{role}", *flags, *common, *config.extra_args.get(role, ()))
        specs.append(ServiceSpec(name, argv, {**env, **(more_env or {})}))

    rendezvous = urlparse(runtime.dist_init)
    if rendezvous.scheme == "mesh":  # the data plane's meeting point: any instance may restart around it
        argv = (python, "-m", "spindle_transfer.rendezvous", "--host", rendezvous.hostname or "127.0.0.1")
        specs.append(ServiceSpec("rendezvous", (*argv, "--port", str(rendezvous.port)), dict(env)))
    kvstore = worker("kvstore-0", 0)
    if config.kvstore_memory_gb is not None:
        kvstore += ["--memory-gb", _num(config.kvstore_memory_gb)]
    add("kvstore-0", "kvstore", kvstore)
    scheduler = ["--strategy", scheduler_strategy(config), "--model", config.model]
    if config.profile is not None:
        scheduler += ["--profile", str(config.profile)]
    add("scheduler", "scheduler", scheduler)
    for i in range(config.prefill):
        node = ["--node", f"node-{i // config.prefill_per_node}"] if config.prefill_per_node else []
        add(f"prefill-{i}", "prefill", worker(f"prefill-{i}", 1 + i) + node + engine(config.kv_cache_tokens, 1 + i))
    decode_tokens = config.decode_kv_cache_tokens or config.kv_cache_tokens
    for i in range(config.decode):
        rank = config.decode_rank(i)
        tp = ["--tp-size", str(config.decode_tp)] if config.decode_tp > 1 else []
        if config.decode_kvp > 1:
            tp = ["--kvp-size", str(config.decode_kvp), "--kvp-tokens", str(config.kvp_tokens)]
            tp += ["--kvp-scale-down-tokens", str(config.kvp_scale_down_tokens)]
        add(f"decode-{i}", "decode", worker(f"decode-{i}", rank) + tp + engine(decode_tokens, rank))
        for j in range(1, config.decode_kvp):
            flags = ["--instance-id", f"decode-{i}", "--rank", str(rank + j), "--leader-rank", str(rank)]
            flags += ["--kvp-size", str(config.decode_kvp), "--world-size", world]
            flags += ["--dist-init", runtime.dist_init, *engine(decode_tokens, rank + j)]
            flags += ["--log-level", config.log_level.upper()]
            if runtime.parent_pid:
                flags += ["--parent-pid", str(runtime.parent_pid)]
            argv = (python, "-m", "spindle_decode.kvp_follower", *flags)
            specs.append(ServiceSpec(f"decode-{i}-kvp{j}", argv, dict(env), survivable=True, unit=f"decode-{i}"))
        for j in range(1, config.decode_tp):
            flags = ["--instance-id", f"decode-{i}", "--rank", str(rank + j), "--leader-rank", str(rank)]
            flags += ["--tp-size", str(config.decode_tp), "--world-size", world]
            flags += ["--dist-init", runtime.dist_init, *engine(decode_tokens, rank + j)]
            flags += ["--log-level", config.log_level.upper()]
            if runtime.parent_pid:
                flags += ["--parent-pid", str(runtime.parent_pid)]
            argv = (python, "-m", "spindle_decode.tp_follower", *flags)
            specs.append(ServiceSpec(f"decode-{i}-tp{j}", argv, dict(env), unit=f"decode-{i}"))
    for i in range(config.elastic):
        rank = 1 + config.prefill + config.decode * config.decode_ranks + i * config.elastic_ranks
        budget = ["--max-num-batched-tokens", str(config.chunk_tokens)]
        if config.shared_chunk is not None:
            budget += ["--shared-chunk", str(config.shared_chunk)]
        # the group holds what one instance cannot (pipelines too, Medha's 3D, with one rank per stage)
        if stack_traits(config.strategy).per_iteration and (config.elastic_spp == 1 or config.elastic_tp == 1):
            budget.append("--partial-kv")
        spp = ["--spp-size", str(config.elastic_spp)] if config.elastic_spp > 1 else []
        spp += ["--tp-size", str(config.elastic_tp)] if config.elastic_tp > 1 else []
        member = "spindle_elastic.spp_stage"
        if config.elastic_reshard:
            budget = ["--reshard", config.elastic_reshard]
            if config.host_kv_tokens is not None:
                budget += ["--host-kv-tokens", str(config.host_kv_tokens)]
            spp = ["--reshard", config.elastic_reshard, "--reshard-size", str(config.elastic_ranks)]
            member = "spindle_elastic.reshard_member"
        add(f"elastic-{i}", "elastic", worker(f"elastic-{i}", rank) + engine(config.kv_cache_tokens, rank) + budget
            + (spp if not config.elastic_reshard else []))  # fmt: skip
        for j in range(1, config.elastic_ranks):
            flags = ["--instance-id", f"elastic-{i}", "--rank", str(rank + j), "--leader-rank", str(rank)]
            flags += [*spp, "--world-size", world]
            flags += ["--dist-init", runtime.dist_init, *engine(config.kv_cache_tokens, rank + j)]
            flags += ["--log-level", config.log_level.upper()]
            if runtime.parent_pid:
                flags += ["--parent-pid", str(runtime.parent_pid)]
            argv = (python, "-m", member, *flags)
            name = f"elastic-{i}-{'member' if config.elastic_reshard else 'spp'}{j}"
            specs.append(ServiceSpec(name, argv, dict(env), unit=f"elastic-{i}"))
    token = {STACK_TOKEN_ENV: runtime.stack_token} if runtime.stack_token else {}
    gateway = ["--host", config.host, "--port", str(runtime.port), "--model", config.model]
    if config.default_max_tokens is not None:
        gateway += ["--default-max-tokens", str(config.default_max_tokens)]
    if config.batch_db is not None:
        gateway += ["--batch-db", config.batch_db]
    add("gateway", "gateway", gateway, token)
    return specs


def default_layout(cpu_count: int | None) -> dict[str, int | str]:
    """`spindle up`'s instances when none are named, by the machine: with fewer than DISAGGREGATE_MIN_CORES cores,
    one elastic instance (chunked prefill mixed into the decode batch, one engine process: on a small CPU box
    several engine processes only take turns on the same cores, and every hand-off is extra work); with more,
    two prefill instances and one decode instance (disaggregated, so long prompts never stall decoding)."""
    if (cpu_count or 1) < DISAGGREGATE_MIN_CORES:
        return {"prefill": 0, "decode": 0, "elastic": 1, "strategy": COLOCATED_STRATEGY}
    return {"prefill": 2, "decode": 1, "elastic": 0, "strategy": "single"}


def check_decode_tp(config: StackConfig) -> None:
    """ValueError when the model's KV heads cannot be split over `decode_tp` ranks (reads the model's config)."""
    if config.decode_tp == 1:
        return
    from spindle_model import resolve_model

    heads = resolve_model(config.model, progress=False).config.num_kv_heads
    if config.decode_tp > heads:
        raise ValueError(
            f"decode_tp {config.decode_tp} exceeds the {heads} KV heads of {config.model} (each tensor-parallel "
            f"rank needs at least one KV head; use --decode-tp 1..{heads})"
        )


def _num(value: float) -> str:
    return f"{value:g}"


def scheduler_strategy(config: StackConfig) -> str:
    """The scheduler's strategy spec: `kvp_tokens` comes from `config.kvp_tokens` unless the spec sets it, and with
    elastic instances `chunk_size` is their per-step token budget unless the spec sets it."""
    chunked = config.strategy.partition(":")[0] == COLOCATED_STRATEGY  # per-iteration strategies name each step
    if config.elastic and chunked and "chunk_size=" not in config.strategy.replace("-", "_"):
        return with_option(config.strategy, "chunk_size", config.chunk_tokens)
    if not config.kvp_tokens or "kvp_tokens=" in config.strategy:
        return config.strategy
    return with_option(config.strategy, "kvp_tokens", config.kvp_tokens)


def with_option(strategy: str, key: str, value: int) -> str:
    """`NAME` or `NAME:a=1` with `key=value` appended: `NAME:key=value`, `NAME:a=1,key=value`."""
    return f"{strategy}{',' if ':' in strategy else ':'}{key}={value}"
