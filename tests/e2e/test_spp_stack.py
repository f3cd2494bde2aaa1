"""A sequence-pipeline instance with tensor parallelism inside each stage on the services (`spindle up --elastic 1
--spp 2 --spp-tp 2`: four engine processes, SmolLM2's 3 KV heads split 2 + 1 in each stage), under the engine's
own chunked scheduler: prompts chunked through both stages, beside running decodes, give the single engine's
tokens and free every block. (The SPP-2 instance under `medha` is in test_medha_stack.py.)"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from .conftest import engine_greedy, instance_blocks, no_blocks_held, start_stack, wait_until
from .sse import read_events

pytestmark = pytest.mark.slow


def test_two_stages_of_two_tp_ranks_serve_like_the_engine(tmp_path_factory, reference_engine, tokenizer):
    stack = start_stack(tmp_path_factory, "spp-tp", prefill=0, decode=0, elastic=1, elastic_spp=2, elastic_tp=2,
                        strategy="chunked:chunk_size=256")  # fmt: skip
    try:
        members = sorted(n for n in stack.processes if n.startswith("elastic-0"))
        assert members == ["elastic-0", "elastic-0-spp1", "elastic-0-spp2", "elastic-0-spp3"]
        rng = random.Random(5)
        prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (700, 9, 300)]
        want = engine_greedy(reference_engine, prompts, max_tokens=8)
        got: dict[int, str] = {}

        def run(i: int) -> None:
            time.sleep(0.3 * i)  # the short ones land while the long one is in chunks
            body = {"model": "smollm2", "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=300) as r:
                assert r.status_code == 200, r.read()
                events = read_events(r)
            got[i] = "".join(c["choices"][0]["text"] for c in events[:-1] if c.get("choices"))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert got == {i: tokenizer.decode(w) for i, w in enumerate(want)}
        assert wait_until(lambda: no_blocks_held(stack), 5), instance_blocks(stack)
    finally:
        stack.stop()
