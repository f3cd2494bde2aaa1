"""`loongserve` on three elastic instances with groups (`spindle up --elastic 3 --strategy loongserve`): a prompt
too long for one instance's KV is computed by a sequence-parallel group whose members keep their shares
(scale-down), then decodes multi-master on them; a decoding group scales up onto an idle instance, handing
requests over to new masters; a later prompt takes an idle instance while others decode; a decoding request's KV
migrates off the instance a prefill wants. Every output equals the single engine's and every block comes back."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import engine_greedy, instance_blocks, start_stack, wait_until, write_assumed_profile

pytestmark = pytest.mark.slow

KV_TOKENS = 1024  # per instance: a 1500-token prompt needs two


def _profile(tmp_path) -> str:
    """Eq. 7 per DoP 1-3 (more instances, faster) and multi-master decode steps; a fast link (migration pays)."""
    batch = {str(d): {"coeffs": [0.02, 4e-4 / d, 2e-8 / d], "fit_error": 0.0} for d in (1, 2, 3)}
    decode = [{"tp": 1, "kvp": k, "coeffs": [0.04 / k, 0.01 / k, 1.6e-05 / k], "fit_error": 0.0} for k in (1, 2, 3)]
    return write_assumed_profile(tmp_path, batch, decode, 1.5e10)


@pytest.fixture(scope="module")
def groups_stack(tmp_path_factory):
    profile = _profile(tmp_path_factory.mktemp("loong-groups-profile"))
    s = start_stack(
        tmp_path_factory, "loong-groups", prefill=0, decode=0, elastic=3, profile=profile,
        strategy="loongserve:scale_up_batch=2,preempt=0", kv_cache_tokens=KV_TOKENS, max_model_len=4096,
    )  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def _complete(stack, prompt: list[int], max_tokens: int, **kw) -> list[int]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(stack.base_url + "/completions", json={**body, **kw, "logprobs": 0}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _tokens(ids: list[int]) -> list[str]:
    from spindle_model import Tokenizer, resolve_model

    tok = Tokenizer(resolve_model("smollm2", progress=False).path)
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def test_a_long_prompt_runs_on_a_group_that_keeps_its_shares(groups_stack, reference_engine):
    prompt = [random.Random(21).randrange(100, 40000) for _ in range(1500)]
    want = engine_greedy(reference_engine, [prompt], max_tokens=16)[0]
    holders: list[dict] = []
    got: list[list[str]] = []
    t = threading.Thread(target=lambda: got.append(_complete(groups_stack, prompt, 16)))
    t.start()
    while t.is_alive():
        held = {i: sum(q.values()) for i, q in instance_blocks(groups_stack).items() if q}
        if held:
            holders.append(held)
        time.sleep(0.02)
    t.join()
    assert got == [_tokens(want)]
    assert any(len(h) >= 2 for h in holders), holders  # decoded with its KV on two instances or more
    assert wait_until(lambda: not any(instance_blocks(groups_stack).values()), 5), instance_blocks(groups_stack)


def test_concurrent_prompts_scale_up_hand_over_and_equal_the_engine(groups_stack, reference_engine):
    rng = random.Random(5)
    lengths = [700, 40, 1200, 90, 300, 15]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    want = engine_greedy(reference_engine, prompts, max_tokens=16)
    got: dict[int, list[str]] = {}

    def run(i: int) -> None:
        time.sleep(0.15 * i)
        got[i] = _complete(groups_stack, prompts[i], 16)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    for i in range(len(prompts)):
        assert got.get(i) == _tokens(want[i]), f"prompt {i}"
    assert wait_until(lambda: not any(instance_blocks(groups_stack).values()), 5), instance_blocks(groups_stack)


def test_a_decoding_request_migrates_off_the_instance_a_long_prefill_takes(groups_stack, reference_engine):
    """Two short requests decode on two instances; a prompt too long for the third idle one takes one of them
    (e_min), whose request's KV moves to the other decoding instance (MigrateKV) and decodes on there."""
    rng = random.Random(8)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (30, 45, 1500)]
    max_tokens = [96, 96, 8]
    want = [engine_greedy(reference_engine, [p], max_tokens=m)[0] for p, m in zip(prompts, max_tokens, strict=True)]
    got: dict[int, list[str]] = {}

    def run(i: int) -> None:
        got[i] = _complete(groups_stack, prompts[i], max_tokens[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for i, th in enumerate(threads):
        if i == 2:  # once both short ones decode, each on its own instance
            assert wait_until(lambda: sum(1 for q in instance_blocks(groups_stack).values() if q) == 2, 20)
        th.start()
        time.sleep(0.3)
    for th in threads:
        th.join(timeout=60)
    for i in range(3):
        assert got.get(i) == _tokens(want[i]), f"prompt {i}"
    logs = "".join(p.read_text() for p in Path(groups_stack.config.log_dir).glob("elastic-*.log"))
    assert "took cmpl-" in logs, "no KV migration happened"
    assert wait_until(lambda: not any(instance_blocks(groups_stack).values()), 5), instance_blocks(groups_stack)


def test_a_killed_group_member_ends_the_groups_requests_and_the_others_serve_on(groups_stack):
    """Last in this module: it leaves the stack with two elastic instances."""
    import signal

    prompt = [random.Random(9).randrange(100, 40000) for _ in range(1500)]
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", groups_stack.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        holders = wait_until(lambda: [i for i, q in instance_blocks(groups_stack).items() if q], 10)
        assert len(holders) >= 2, holders  # its KV is spread over a group
        t0 = time.monotonic()
        groups_stack.processes[holders[-1]].send_signal(signal.SIGKILL)
        tail = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - t0 < 15
    assert tail[-1] == "data: [DONE]" and '"error"' in tail[-2], tail[-3:]
    alive = [i for i in groups_stack.processes if i.startswith("elastic-") and i != holders[-1]]
    freed = wait_until(lambda: not any(instance_blocks(groups_stack).get(i) for i in alive), 10)
    assert freed, instance_blocks(groups_stack)
    # until the scheduler sees the death (no heartbeat for 2.5 s) a new group may include the dead member: 503
    hi = {"model": "smollm2", "prompt": "Hi", "max_tokens": 3}
    post = lambda: httpx.post(groups_stack.base_url + "/completions", json=hi, timeout=60)  # noqa: E731
    ok = wait_until(lambda: (r := post()).status_code == 200 and r, 10)
    assert ok and ok.json()["usage"]["completion_tokens"] == 3
