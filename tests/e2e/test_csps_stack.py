"""`spindle up --strategy csps`: a prompt over both prefill instances with all-to-all SP (CSA off by default) gives
the single engine's greedy tokens through the `openai` client; the same prompt with CSA dropping tokens (sent to
the instances directly) reports the dropped tokens in its usage; no block stays held."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .conftest import engine_greedy, instance_blocks, start_stack, wait_until
from .direct import run_plan
from .test_sp_stack import _profile

pytestmark = pytest.mark.slow


def test_csps_serves_like_the_single_engine_and_reports_what_csa_dropped(
    tmp_path_factory, tmp_path, tokenizer, reference_engine
):
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    ids = tokenizer.encode(filler * 30 + "The pass key is 68413. Remember it. " + filler * 20 + "The pass key is")
    expected = engine_greedy(reference_engine, [ids], 6)[0]
    stack = start_stack(tmp_path_factory, "csps", prefill=2, decode=1, strategy="csps:max_sp=2",
                        profile=_profile(tmp_path))  # fmt: skip
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none")
        done = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
        assert done.choices[0].text == tokenizer.decode(expected)
        assert done.usage.model_extra["spindle"]["csa_dropped_tokens"] == 0
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)

        members = ["prefill-0", "prefill-1"]
        tokens, error, stats = asyncio.run(
            run_plan(stack, ids, [(0, len(ids), members)], 6, layout="all-to-all", csa_drop=0.3)
        )
        assert error is None and len(tokens) == 6, error
        half = len(ids) // 2
        assert stats is not None and stats["csa_dropped_tokens"] == round(0.3 * (len(ids) - half)) + round(0.3 * half)
        assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)
        print(f"\n{len(ids)} tokens; dense {expected}, CSA p=0.3 {tokens} ({stats['csa_dropped_tokens']:.0f} dropped)")
    finally:
        stack.stop()
