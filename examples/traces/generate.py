"""Writes the two example traces beside this file (deterministic): 64 requests of the `mixed-chat` workload at
2 req/s, as a Mooncake / AIPerf JSONL trace and as a BurstGPT CSV.

    .venv/bin/python examples/traces/generate.py

In the Mooncake file every prompt opens with the same 1,024-token system prompt (block hash ids 0 and 1, at
Mooncake's 512 tokens a block); the rest of each prompt has ids of its own. The BurstGPT file carries two failed
requests (0 response tokens), which readers skip, as in the published trace.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

from spindle_sim.traces import write_mooncake
from spindle_sim.workloads import make_workload

HERE = Path(__file__).parent
BLOCK = 512  # Mooncake's tokens per hash id
SYSTEM_BLOCKS = 2


def main() -> None:
    trace = make_workload("mixed-chat", 64, 2.0, seed=7)
    next_id = SYSTEM_BLOCKS
    with_hashes = []
    for r in trace:
        prompt = r.num_prefill_tokens + SYSTEM_BLOCKS * BLOCK
        own = -(-prompt // BLOCK) - SYSTEM_BLOCKS
        with_hashes.append(replace(r, num_prefill_tokens=prompt, hash_ids=(0, 1, *range(next_id, next_id + own))))
        next_id += own
    write_mooncake(HERE / "mooncake_example.jsonl", with_hashes)
    with open(HERE / "burstgpt_example.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        for k, r in enumerate(trace):
            output = 0 if k in (10, 40) else r.num_decode_tokens  # the trace's failed requests
            model = "ChatGPT" if k % 4 else "GPT-4"
            w.writerow([round(5.0 + r.arrived_at, 3), model, r.num_prefill_tokens, output,
                        r.num_prefill_tokens + output, "Conversation log"])  # fmt: skip


if __name__ == "__main__":
    main()
