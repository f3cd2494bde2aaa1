"""Fixtures for end-to-end tests: a real stack (nats-server, kvstore, scheduler, prefill, decode, gateway
processes on the real model) started by the launcher, and the single-instance engine as the reference."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from spindle_launcher.plan import StackConfig
from spindle_launcher.stack import Stack
from spindle_telemetry.testing import OtlpReceiver

MAX_MODEL_LEN = 4096

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def start_stack(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides) -> Stack:
    log_dir = tmp_path_factory.mktemp(f"logs-{name}")
    config = StackConfig(
        port=0,
        max_model_len=overrides.pop("max_model_len", MAX_MODEL_LEN),
        kv_cache_tokens=overrides.pop("kv_cache_tokens", 2 * MAX_MODEL_LEN),
        kvstore_memory_gb=0.5,
        log_dir=str(log_dir),
        batch_db=overrides.pop("batch_db", str(log_dir / "batches.sqlite")),  # not the user's default store
        **overrides,
    )
    return Stack(config).start()


def start_slow_decode_stack(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides) -> Stack:
    """`start_stack` with the engines on the torch path (`SPINDLE_CPU_KERNELS=0` in their environment), for
    scenarios that need a request to hold a decode instance while the next ones arrive (parking, moving, time
    slicing): with the native kernels a short decode ends before the scheduler's timers fire."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPINDLE_CPU_KERNELS", "0")
        return start_stack(tmp_path_factory, name, **overrides)


@pytest.fixture(scope="session")
def otlp():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def stack(tmp_path_factory, otlp):
    """2 prefill + 1 decode instances, exporting traces to the in-test OTLP receiver."""
    s = start_stack(tmp_path_factory, "main", prefill=2, decode=1, otlp_endpoint=otlp.endpoint)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference_engine():
    from spindle_engine import Engine, EngineConfig

    return Engine(EngineConfig(model="smollm2", kv_cache_tokens=16384, max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def tokenizer():
    from spindle_model import Tokenizer, resolve_model

    return Tokenizer(resolve_model("smollm2", progress=False).path)


def no_blocks_held(stack) -> bool:
    """No instance of the stack holds a KV block for any request."""
    return not any(instance_blocks(stack).values())


def engine_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What the single-instance engine generates greedily for each prompt."""
    from spindle_engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"ref-{time.monotonic_ns()}-{i}", ids, params)
    out: dict[str, list[int]] = {}
    order: list[str] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id not in out:
                order.append(o.request_id)
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("-", 1)[1]))]


def instance_blocks(stack: Stack) -> dict[str, dict[str, int]]:
    """instance id -> {request id: blocks held}, exact, from every instance that answers (a dead one, still
    registered, reports an error instead)."""
    r = httpx.get(stack.url + "/v1/spindle/instances", timeout=5)
    r.raise_for_status()
    return {i["instance_id"]: i["requests"] for i in r.json()["instances"] if "requests" in i}


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def greedy_text(base_url: str, ids: list[int], max_tokens: int = 8) -> str:
    """A greedy completion of token ids through the gateway: its text, or the HTTP error it got."""
    body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base_url + "/completions", timeout=300, json=body)
    return r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}: {r.text}"


def write_assumed_profile(tmp_path, batch_prefill: dict, decode: list[dict], bandwidth_bytes_per_s: float) -> str:
    """A latency profile with assumed numbers (a strategy only compares plans with them): Eq. 7 per DoP
    (`batch_prefill`), decode steps per (tp, kvp), a whole-prompt prefill for SP 1 and the transfer link."""
    model = {
        "version": 1,
        "source": "test: assumed",
        "prefill": {"1": {"coeffs": [0.08, 0.002, 9e-7, 1.2e-6], "fit_error": 0.0, "history_inferred": False}},
        "batch_prefill": batch_prefill,
        "decode": decode,
        "transfer": {"latency_s": 0.001, "bandwidth_bytes_per_s": bandwidth_bytes_per_s},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": model}))
    return str(path)


def supervise(stack: Stack) -> threading.Thread:
    """Restart what dies from now on, as `spindle up` does (Stack.wait on a thread of its own until stop())."""
    thread = threading.Thread(target=stack.wait, name="test-supervisor", daemon=True)
    thread.start()
    return thread


def back_in_service(stack: Stack, role: str, restarts: int, timeout: float = 90) -> float:
    """Wait until `role` has been restarted `restarts` times in all and every planned instance is live and answers;
    the seconds it took."""
    t0 = time.monotonic()

    def full() -> bool:
        if stack.restarts.get(role, 0) < restarts:
            return False
        try:
            return set(instance_blocks(stack)) >= set(stack.config.instance_ids())
        except httpx.HTTPError:
            return False

    assert wait_until(full, timeout, 0.2), f"{role} not back: restarts {stack.restarts}"
    return time.monotonic() - t0
