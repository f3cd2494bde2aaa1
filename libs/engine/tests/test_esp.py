"""Elastic sequence parallelism on gloo processes (spindle_engine.esp): prompts computed over a group with each
member retaining an uneven range, multi-master decoding whose masters move (with and without a hand-over),
groups that shrink and run side by side, KV migration, and requests that end or are aborted while the command
still names them. Every token equals one engine's, greedy and seeded, and every block comes back."""

import json

import pytest
import torch

from spindle_engine.esp.testing import reference_tokens, script_worker
from spindle_model.testing import run_gloo

MAX_TOKENS = 8


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    lens = (("a", 37), ("b", 23), ("c", 50), ("d", 2))  # d: shorter than the group (a member computes nothing)
    return {rid: torch.randint(3, 301, (n,), generator=g).tolist() for rid, n in lens}


def _steps() -> list[dict]:
    all3 = [0, 1, 2]
    steps: list[dict] = [
        # a over three members (13 / 17 / 7 tokens retained), b retained whole by member 1
        {"members": all3, "prefills": [["a", {"0": [0, 13], "1": [13, 30], "2": [30, 37]}], ["b", {"1": [0, 23]}]]},
        {"members": all3, "prefills": [["d", {"2": [0, 2]}]]},
        {"members": all3, "decodes": [["a", 2], ["b", 1]]},
        {"members": all3, "decodes": [["a", 0], ["b", 0]]},  # a: 0 holds a part; b: handed over from 1 to 0
        {"members": all3, "decodes": [["a", 1], ["b", 0]]},
        {"members": [2], "prefills": [["c", {"0": [0, 50]}]]},  # a group of one
        {"members": [2], "decodes": [["c", 0]]},
        {"migrate": ["c", 2, 0]},  # all of c's KV moves to rank 0
        {"members": all3, "decodes": [["a", 2], ["b", 1], ["c", 0]]},
        {"members": [0, 1], "decodes": [["b", 0]]},  # b's holders alone (a skips a step)...
        {"members": [2, 1, 0], "decodes": [["a", 0], ["c", 2]]},  # ... then a group in another order
    ]
    for i in range(MAX_TOKENS):  # more steps than tokens left: ended requests are skipped on every member
        steps.append({"members": all3, "decodes": [["a", i % 3], ["b", (i + 1) % 3], ["c", 2], ["d", (i + 2) % 3]]})
    return steps


def _assert_tokens_and_nothing_held(ranks: list[dict], want: dict[str, list[int]]) -> None:
    """Every request's tokens, gathered from whichever member sampled each (once), equal `want`; no member holds a
    block or a directed request."""
    for rid, tokens in want.items():
        got: dict[int, int] = {}
        for r in ranks:
            if f"index:{rid}" in r:
                for i, t in zip(r[f"index:{rid}"].tolist(), r[f"tokens:{rid}"].tolist(), strict=True):
                    assert i not in got, f"{rid}: output {i} sampled twice"
                    got[i] = t
        assert [got.get(i) for i in range(len(tokens))] == tokens, rid
    assert [int(r["blocks"]) for r in ranks] == [0] * len(ranks)
    assert [int(r["directed"]) for r in ranks] == [0] * len(ranks)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_elastic_groups_give_one_engines_tokens(tmp_path, kind: str) -> None:
    prompts = _prompts()
    want = reference_tokens(prompts, kind, MAX_TOKENS)
    script = {"prompts": prompts, "sampling": kind, "max_tokens": MAX_TOKENS, "steps": _steps()}
    ranks = run_gloo(script_worker, 3, tmp_path, json.dumps(script), timeout=240)
    _assert_tokens_and_nothing_held(ranks, want)


def test_an_abort_seen_by_one_member_drops_the_request_everywhere(tmp_path) -> None:
    prompts = _prompts()
    del prompts["d"]
    want = reference_tokens({"a": prompts["a"]}, "greedy", MAX_TOKENS)
    all3 = [0, 1, 2]
    steps = [
        {"members": all3, "prefills": [["a", {"0": [0, 20], "2": [20, 37]}], ["b", {"0": [0, 5], "1": [5, 23]}]]},
        {"members": all3, "decodes": [["a", 2], ["b", 1]], "aborted": {"2": ["b"]}},  # only member 2 knows
    ]
    steps += [{"members": all3, "decodes": [["a", i % 3], ["b", 0]]} for i in range(MAX_TOKENS)]
    script = {"prompts": prompts, "sampling": "greedy", "max_tokens": MAX_TOKENS, "steps": steps}
    ranks = run_gloo(script_worker, 3, tmp_path, json.dumps(script), timeout=240)
    b_tokens = sum(r["tokens:b"].numel() for r in ranks if "tokens:b" in r)
    assert b_tokens == 1  # its first token, from the prefill; never decoded
    got = {}
    for r in ranks:
        if "index:a" in r:
            got |= dict(zip(r["index:a"].tolist(), r["tokens:a"].tolist(), strict=True))
    assert [got[i] for i in range(MAX_TOKENS)] == want["a"]
    assert [int(r["blocks"]) for r in ranks] == [0, 0, 0]


def test_kv_parallel_chunks_spill_a_prompt_over_members(tmp_path) -> None:
    """Medha's KVP (§3.4): a prompt's chunks computed by one member after another (uneven sizes), each attending the
    earlier chunks' KV where it stays, beside another request's chunks and decodes; then decodes on the last
    member over all three parts, and on a member that holds a middle part."""
    g = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(3, 301, (n,), generator=g).tolist() for rid, n in (("e", 70), ("f", 20))}
    want = reference_tokens(prompts, "greedy", MAX_TOKENS)
    all3 = [0, 1, 2]
    steps: list[dict] = [
        {"members": [0], "chunks": [["e", 0, 0, 25]]},  # e on member 0 alone
        {"members": [1], "chunks": [["f", 0, 0, 9]]},  # f on member 1 alone (member index 0 of [1])
        {"members": [0, 1], "chunks": [["e", 1, 25, 41], ["f", 1, 9, 20]]},  # e spills onto 1 (a hand-over)
        {"members": all3, "chunks": [["e", 2, 41, 70]], "decodes": [["f", 1]]},  # and onto 2: its first token
        {"members": all3, "decodes": [["e", 2], ["f", 1]]},
        {"members": all3, "decodes": [["e", 1], ["f", 1]]},  # a holder of the middle part masters a step
    ]
    steps += [{"members": all3, "decodes": [["e", 2], ["f", (i + 1) % 3]]} for i in range(MAX_TOKENS)]
    script = {"prompts": prompts, "sampling": "greedy", "max_tokens": MAX_TOKENS, "steps": steps}
    ranks = run_gloo(script_worker, 3, tmp_path, json.dumps(script), timeout=240)
    _assert_tokens_and_nothing_held(ranks, want)
