"""`spindle up`: start the whole stack on this machine and supervise it until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import replace

from spindle_policy.strategy import stack_traits

from .gpus import DEVICES, gpu_map, parse_gpus
from .plan import (
    DEFAULT_CHUNK_TOKENS,
    DISAGGREGATE_MIN_CORES,
    DTYPES,
    Runtime,
    StackConfig,
    build_plan,
    check_decode_tp,
    default_layout,
    plan_ranks,
    with_option,
)
from .restarts import DEFAULT_RESTART
from .stack import Stack, StackError, StackInterrupted, check_ports
from .supervisor import describe_exit


def build_parser() -> argparse.ArgumentParser:
    from spindle_policy.strategy import available_strategies  # the registry (no torch)

    p = argparse.ArgumentParser(prog="spindle", description="Spindle: long-context LLM serving.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("sim", add_help=False, help="simulate a cluster running a strategy (`spindle sim --help`)")
    sub.add_parser(
        "profile",
        add_help=False,
        help="measure this machine's engine (prefill, decode, KV transfer) and write a latency profile JSON",
    )
    sub.add_parser(
        "tune",
        add_help=False,
        help="search a strategy's tuning table in the simulator (`spindle tune tetris --help`)",
    )
    sub.add_parser(
        "cost",
        add_help=False,
        help="predict one prefill / decode step / mixed batch on a GPU cluster, op by op (`spindle cost --help`)",
    )
    sub.add_parser(
        "add",
        add_help=False,
        help="start more prefill / decode instances in a running `spindle up` (`spindle add --help`)",
    )
    sub.add_parser(
        "verify",
        add_help=False,
        help="check that a sequence-parallel prefill plan gives the single-instance result (`spindle verify --help`)",
    )
    up = sub.add_parser(
        "up",
        help="start nats-server, kvstore, scheduler, the model instances and the gateway",
        description="Start the whole Spindle stack on this machine, wait until it is ready, print the URL, "
        "and stop it all on Ctrl-C / SIGTERM. A service that dies stops the stack (exit status 1).",
    )
    m = up.add_argument_group("model and engine")
    m.add_argument("--model", default="smollm2", help="known model name, HF Llama directory or .gguf (%(default)s)")
    m.add_argument("--dtype", default="float32", choices=DTYPES)
    m.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="where the engines run: cpu, or cuda (every rank but the kvstore's on a GPU of --gpus) (%(default)s)",
    )
    m.add_argument(
        "--gpus",
        default=None,
        metavar="ID,ID,...",
        help="with --device cuda: the GPUs the ranks take round-robin in rank order, one per rank while they last "
        "(a TP/KVP/SPP group's members on different GPUs when there are enough; more ranks than GPUs share them, "
        "and a GPU's KV memory is split between its processes). Ids as torch numbers them here (default: 0)",
    )
    m.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache capacity per instance, in tokens")
    m.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV cache size per instance (GB)")
    m.add_argument(
        "--decode-kv-cache-tokens", type=int, default=None, help="KV cache tokens of decode instances (overrides)"
    )
    m.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    m.add_argument("--kvstore-memory-gb", type=float, default=None, help="host memory budget of the kvstore (GB)")
    c = up.add_argument_group(
        "instances and scheduling",
        f"With none of --prefill, --decode, --elastic the layout follows the machine: fewer than "
        f"{DISAGGREGATE_MIN_CORES} CPU cores (os.cpu_count(); this one has {os.cpu_count()}) -> --elastic 1 (one "
        "colocated engine: chunked prefill mixed into the decode batch); more -> --prefill 2 --decode 1 "
        "(disaggregated). Naming --prefill/--decode, or a --strategy other than chunked, loongserve and medha (the "
        "strategies of elastic instances), gives the disaggregated layout (2 and 1 unless named).",
    )
    c.add_argument("--prefill", type=int, default=None, help="prefill instances")
    c.add_argument("--decode", type=int, default=None, help="decode instances")
    c.add_argument(
        "--elastic",
        type=int,
        default=None,
        help="elastic (colocated) instances, instead of prefill and decode ones: each runs a request's prefill, a "
        "chunk per step beside its running decodes (--chunk-size), and its decode, in one engine process; strategy "
        "chunked",
    )
    c.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help=f"with elastic instances: prompt tokens per engine step, the per-step token budget "
        f"({DEFAULT_CHUNK_TOKENS}; smaller chunks stall running decodes less, larger ones prefill faster)",
    )
    c.add_argument(
        "--shared-chunk-size",
        type=int,
        default=None,
        help="with elastic instances: prompt tokens one request may take per step while other requests share the "
        "instance, so a long prompt interleaves with the decodes and newer prompts; alone it takes --chunk-size "
        "(the instance's default, 512; 0 = no cap)",
    )
    c.add_argument(
        "--spp",
        type=int,
        default=1,
        help="with elastic instances: sequence-pipeline stages per instance, one process each holding a layer "
        "range; consecutive chunks of a prompt flow through them back to back (Medha's SPP). Strategies chunked "
        "and medha (they keep a request's KV on its instance) (%(default)s)",
    )
    c.add_argument(
        "--spp-tp",
        type=int,
        default=1,
        help="with --spp > 1: tensor-parallel ranks inside each stage (Medha's 2D: --spp x --spp-tp processes per "
        "instance; at most the model's KV heads) (%(default)s)",
    )
    c.add_argument(
        "--reshard",
        default=None,
        metavar="PREFILL:DECODE",
        help="with --strategy seesaw: each elastic instance a re-sharding group of these configurations, e.g. "
        "PP2:TP2 (the default): prefill as a pipeline into the group's host KV tier, decode tensor-parallel, the "
        "weights reloaded from shared host memory at each switch",
    )
    c.add_argument(
        "--host-kv-tokens",
        type=int,
        default=None,
        help="with --strategy seesaw: each group's host KV tier in tokens (default: 2 GiB of shared memory)",
    )
    c.add_argument(
        "--prefill-per-node",
        type=int,
        default=0,
        help="prefill instances per (virtual) node: they report nodes node-0, node-1, ..., which node-aware "
        "strategies (tetris) keep SP groups inside; 0: all report this host (%(default)s)",
    )
    c.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per decode instance, at most the model's KV heads (%(default)s)",
    )
    c.add_argument(
        "--decode-kvp",
        type=int,
        default=1,
        help="KV-parallel members (processes) per decode group: a request's KV may be split by token ranges "
        "over them, each member with the decode KV cache size of its own; every member registers as a decode "
        "instance (decode-I, decode-I-kvpJ) and the scheduler places requests over members by freeness "
        "(%(default)s; needs --decode-tp 1)",
    )
    c.add_argument(
        "--kvp-tokens",
        type=int,
        default=0,
        help="with --decode-kvp > 1: per-member KV token limit of a new request; the scheduler splits a longer "
        "prompt over ceil(len / N) members of a group (the strategy's kvp_tokens=N unless --strategy sets it), "
        "and a member running out of blocks hands the request's new tokens to another (scale-up). 0 = on one "
        "member, or split by capacity when no member could hold it (%(default)s)",
    )
    c.add_argument(
        "--kvp-scale-down-tokens",
        type=int,
        default=0,
        help="with --decode-kvp > 1: a request's range shorter than this (not on its master) moves once into a "
        "neighbouring member with room (scale-down), so fewer members serve it; 0 = never (%(default)s)",
    )
    c.add_argument(
        "--strategy",
        default=None,
        help="scheduler strategy, NAME or NAME:key=value,... (single; chunked with elastic instances, or "
        "loongserve / medha with --profile: the scheduler names each iteration); registered: "
        f"{', '.join(available_strategies())}",
    )
    c.add_argument(
        "--profile",
        default=None,
        help="latency profile JSON (`spindle profile`) for fixed-sp / request-sp / tetris / csps / loongserve / medha",
    )
    n = up.add_argument_group("network and operations")
    n.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a chat request that sends none (default: the model's generation config, else the "
        "context's room)",
    )
    n.add_argument(
        "--batch-db",
        default=None,
        help="the gateway's Batch API store, an SQLite file kept across restarts (default: per gateway port under "
        "$XDG_STATE_HOME or ~/.local/state/spindle; 'off': no Batch API)",
    )
    n.add_argument("--host", default="127.0.0.1", help="gateway bind address (%(default)s)")
    n.add_argument("--port", type=int, default=8000, help="gateway port (%(default)s; 0 = any free port)")
    n.add_argument("--nats-port", type=int, default=None, help="nats-server client port (default: a free port)")
    n.add_argument("--otlp-endpoint", default=None, help="OTLP/gRPC trace endpoint for every service")
    n.add_argument("--log-level", default="INFO", help="services' log level (%(default)s)")
    n.add_argument("--log-dir", default=None, help="write each service's output to LOG_DIR/NAME.log")
    n.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness (%(default)s)")
    n.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_RESTART.max_restarts,
        help="a dead process is restarted (with its instance's other processes) after a back-off doubling from "
        f"{DEFAULT_RESTART.backoff_s:g} s to {DEFAULT_RESTART.backoff_max_s:g} s while the rest serve on; this many "
        f"restarts within {DEFAULT_RESTART.window_s:g} s is a crash loop and it stays down (%(default)s)",
    )
    n.add_argument("--no-restart", action="store_true", help="stop the whole stack when any process dies")
    n.add_argument("--dry-run", action="store_true", help="print the service commands and exit")
    return p


def layout_from_args(args: argparse.Namespace, cpu_count: int | None = None) -> dict[str, int | str]:
    """The instances and strategy of `spindle up`: as named, or by the machine (plan.default_layout)."""
    name = args.strategy.partition(":")[0].strip() if args.strategy is not None else ""
    named_split = bool(name) and not stack_traits(name).colocated
    if args.elastic is None and args.prefill is None and args.decode is None and not named_split:
        layout = default_layout(os.cpu_count() if cpu_count is None else cpu_count)
        if name and not layout["elastic"]:  # a strategy of elastic instances on a machine that defaults to a split
            layout = {"prefill": 0, "decode": 0, "elastic": layout["prefill"] + layout["decode"], "strategy": name}
    elif args.elastic:
        layout = {"prefill": args.prefill or 0, "decode": args.decode or 0, "elastic": args.elastic}
        layout["strategy"] = "chunked"
    else:
        layout = {"prefill": 2 if args.prefill is None else args.prefill, "elastic": args.elastic or 0}
        layout |= {"decode": 1 if args.decode is None else args.decode, "strategy": "single"}
    if args.strategy is not None:
        layout["strategy"] = args.strategy
    if args.shared_chunk_size is not None:
        if args.shared_chunk_size < 0:
            raise ValueError(f"--shared-chunk-size must be >= 0, got {args.shared_chunk_size}")
        if not layout["elastic"]:
            raise ValueError("--shared-chunk-size applies to elastic instances (--elastic N)")
        layout["shared_chunk"] = args.shared_chunk_size
    if args.chunk_size is not None:
        if args.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {args.chunk_size}")
        if not layout["elastic"]:
            raise ValueError("--chunk-size applies to elastic instances (--elastic N)")
        layout["strategy"] = with_option(str(layout["strategy"]), "chunk_size", args.chunk_size)
    return layout


DEFAULT_RESHARD = "PP2:TP2"


def reshard_from_args(args: argparse.Namespace) -> str:
    """--reshard, or PP2:TP2 under a re-sharding strategy (seesaw)."""
    name = args.strategy.partition(":")[0].strip() if args.strategy is not None else ""
    if args.reshard is not None:
        return args.reshard
    return DEFAULT_RESHARD if name and stack_traits(name).reshards else ""


def config_from_args(args: argparse.Namespace) -> StackConfig:
    return StackConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        gpus=parse_gpus(args.gpus) if args.gpus is not None else (),
        **layout_from_args(args),  # type: ignore[arg-type]
        decode_tp=args.decode_tp,
        decode_kvp=args.decode_kvp,
        elastic_spp=args.spp,
        elastic_tp=args.spp_tp,
        elastic_reshard=reshard_from_args(args),
        host_kv_tokens=args.host_kv_tokens,
        prefill_per_node=args.prefill_per_node,
        kvp_tokens=args.kvp_tokens,
        kvp_scale_down_tokens=args.kvp_scale_down_tokens,
        host=args.host,
        port=args.port,
        nats_port=args.nats_port,
        profile=args.profile,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        decode_kv_cache_tokens=args.decode_kv_cache_tokens,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        batch_db=args.batch_db,
        kvstore_memory_gb=args.kvstore_memory_gb,
        otlp_endpoint=args.otlp_endpoint,
        log_level=args.log_level,
        ready_timeout=args.ready_timeout,
        log_dir=args.log_dir,
        restart=None if args.no_restart else replace(DEFAULT_RESTART, max_restarts=args.max_restarts),
    )


def _say(line: str) -> None:
    print(f"spindle: {line}", flush=True)


def serve(stack: Stack, say: Callable[[str], None] = _say) -> int:
    """Start `stack`, supervise it until request_stop() or a child's death; the process exit status."""
    try:
        stack.start()
    except StackInterrupted:
        say("stopped")
        return 0
    except (StackError, RuntimeError) as e:
        say(f"failed to start: {e}")
        return 1
    try:
        print(f"Spindle is up: {stack.base_url}  (NATS {stack.nats_url}; Ctrl-C stops)", flush=True)
        dead = stack.wait()
        if dead is None:
            say("stopping")
            return 0
        name, code = dead
        where = stack.log_path(name)
        log_hint = f"; log: {where}" if where else ""
        say(f"{name} exited unexpectedly ({describe_exit(code)}); stopping the stack{log_hint}")
        return 1
    finally:
        stack.stop()


SERVING_PACKAGES = ("spindle_engine", "spindle_model", "spindle_tokenizer", "spindle_transfer")
TORCH_FREE_COMMANDS = ("sim", "tune", "cost")


def check_serving_install(command: str) -> None:
    """`spindle sim` / `tune` / `cost` need no torch; every other command runs the engine, which the launcher's
    `[serve]` extra installs: say so instead of failing on an import deep inside."""
    if command in TORCH_FREE_COMMANDS:
        return
    missing = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"spindle {command} runs the model, and this install has no {', '.join(missing)}: install the serving "
            "packages (`make install`, or `pip install -e 'services/launcher[serve]'` with the libs/ and services/ "
            "packages); `spindle sim`, `spindle tune` and `spindle cost` work without them"
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-"):
        check_serving_install(argv[0])
    if argv[:1] == ["profile"]:
        from .profile.cli import main as profile_main

        sys.exit(profile_main(argv[1:]))
    if argv[:1] == ["add"]:
        from .add import main as add_main

        sys.exit(add_main(argv[1:]))
    if argv[:1] == ["tune"]:
        from spindle_sim.tune import main as tune_main

        sys.exit(tune_main(argv[1:]))
    if argv[:1] == ["cost"]:
        from spindle_costmodel.cli import main as cost_main

        sys.exit(cost_main(argv[1:]))
    if argv[:1] == ["verify"]:
        from spindle_engine.sp.verify import main as verify_main

        sys.exit(verify_main(argv[1:]))
    if argv[:1] == ["sim"]:
        from spindle_sim.commands import main as sim_main

        sys.exit(sim_main(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if not args.dry_run:
        try:
            check_ports(config)  # first: a taken port fails within a second, before any model is read
        except StackError as e:
            _say(f"failed to start: {e}")
            sys.exit(1)
    try:
        check_decode_tp(config)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        nats_url = f"nats://127.0.0.1:{args.nats_port or 4222}"
        runtime = Runtime(nats_url=nats_url, dist_init="mesh://127.0.0.1:29500", port=config.port or 8000)
        specs = build_plan(config, runtime)
        for line in gpu_map(config.rank_devices(), plan_ranks(specs)):
            print(f"# GPU map: {line}")
        for spec in specs:
            print(f"{spec.name}: {shlex.join(spec.argv)}")
        return
    stack = Stack(config, echo=_say)
    stop_on_signals(stack)
    sys.exit(serve(stack))


def stop_on_signals(stack: Stack) -> None:
    """Ctrl-C, SIGTERM and SIGHUP ask the stack to stop (in order) instead of killing the launcher."""

    def on_signal(signum: int, frame: object) -> None:
        stack.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
