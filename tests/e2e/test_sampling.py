"""Sampling parameters and logprobs through the real stack (2 prefill + 1 decode instances) with the official
`openai` client: penalties, logit_bias, min_tokens, min_p and seeded sampling give the single engine's tokens,
and the logprobs, streamed and not, equal the engine's (the first token's come from the prefill instance)."""

from __future__ import annotations

import openai
import pytest

from .conftest import instance_blocks, wait_until
from .sampling_check import LOGPROB_TOL, assert_stream_matches, engine_reference, penalised_body, stream_completion

pytestmark = pytest.mark.slow

STORY = "Once upon a time in a land far away, there lived a curious fox who loved to"


def test_penalised_sampling_and_logprobs_equal_the_engine(stack, reference_engine, tokenizer):
    prompt = tokenizer.encode(STORY, add_special_tokens=False)
    body = penalised_body(prompt, max_tokens=24, banned=tokenizer.encode(" the", add_special_tokens=False)[0])
    tokens, logprobs = engine_reference(reference_engine, body)
    assert body["logit_bias"] and int(next(iter(body["logit_bias"]))) not in tokens
    assert_stream_matches(stream_completion(stack.base_url, body), tokenizer, tokens, logprobs)

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    extra = {k: body[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens")}
    whole = client.completions.create(
        model="smollm2",
        prompt=prompt,
        max_tokens=body["max_tokens"],
        temperature=body["temperature"],
        seed=body["seed"],
        presence_penalty=body["presence_penalty"],
        frequency_penalty=body["frequency_penalty"],
        logit_bias=body["logit_bias"],
        logprobs=body["logprobs"],
        extra_body=extra,
    )
    choice = whole.choices[0]
    assert choice.text == tokenizer.decode(tokens)
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in logprobs], abs=LOGPROB_TOL)
    assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)


def test_chat_logprobs_with_the_openai_client_streamed_and_not(stack, reference_engine, tokenizer):
    from spindle_engine import SamplingParams

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kw = {"model": "smollm2", "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**kw, top_logprobs=2)
    streamed = client.chat.completions.create(**kw, top_logprobs=2, stream=True)
    content = whole.choices[0].logprobs.content
    chunks = [ch.choices[0] for ch in streamed if ch.choices]
    streamed_content = [c for ch in chunks if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in content] == [c.token for c in streamed_content]
    assert [c.logprob for c in content] == pytest.approx([c.logprob for c in streamed_content], abs=1e-6)

    ids = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    reference_engine.add_request("ref-chat-lp", ids, SamplingParams(max_tokens=10, temperature=0, logprobs=2))
    ref = []
    while reference_engine.has_unfinished():
        ref += [lp for o in reference_engine.step() if o.request_id == "ref-chat-lp" for lp in o.logprobs or []]
    assert [c.token for c in content] == [tokenizer.decode([lp.token_id], skip_special_tokens=False) for lp in ref]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in ref], abs=LOGPROB_TOL)
    for c, lp in zip(content, ref, strict=True):
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(lp.top_logprobs[0], abs=LOGPROB_TOL)
    assert "".join(c.token for c in content).startswith("The capital of France is Paris")


def test_n_choices_share_one_prefill_and_each_equals_the_engine(stack, reference_engine, tokenizer):
    """n = 3: one prefill, the KV handed off once; the decode instance gives each choice its own copy and each
    samples from its own seed (choice_seed): each choice equals the single engine run as one request."""
    from spindle_engine import SamplingParams
    from spindle_engine.sampling_params import choice_seed

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    prompt = tokenizer.encode(STORY, add_special_tokens=False)
    resp = client.completions.create(
        model="smollm2", prompt=prompt, n=3, max_tokens=12, temperature=0.9, seed=77, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for i in range(3):
        params = SamplingParams(max_tokens=12, temperature=0.9, seed=choice_seed(77, i), ignore_eos=True)
        reference_engine.add_request(f"ref-n-{i}", prompt, params)
    ref: dict[str, list[int]] = {}
    while reference_engine.has_unfinished():
        for o in reference_engine.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [c.text for c in resp.choices] == [tokenizer.decode(ref[f"ref-n-{i}"]) for i in range(3)]
    assert len({c.text for c in resp.choices}) > 1
    assert resp.usage.completion_tokens == 36
    assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)

    streamed = client.completions.create(
        model="smollm2", prompt=prompt, n=3, max_tokens=12, temperature=0.9, seed=77, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in resp.choices]


def test_closing_an_n_choice_stream_frees_every_choice(stack, tokenizer):
    import httpx

    body = {"model": "smollm2", "prompt": STORY, "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 12:
                break
    assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)


def test_structured_output_with_the_openai_client(stack, reference_engine, tokenizer):
    """A JSON-schema response parses and validates and equals the single engine's; a required tool call comes back
    as tool_calls; a guided regex holds."""
    import json

    from spindle_engine import SamplingParams

    from .sampling_check import PERSON_SCHEMA, check_person, engine_tokens

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    messages = [{"role": "user", "content": "Invent a person and give their name, age and city."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    resp = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=80, response_format=fmt
    )
    text = resp.choices[0].message.content
    check_person(text)
    ids = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    grammar = ("json_schema", json.dumps(PERSON_SCHEMA))
    ref = engine_tokens(reference_engine, ids, SamplingParams(max_tokens=80, temperature=0, grammar=grammar))
    assert text == tokenizer.decode(ref)

    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }
    call = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        temperature=0,
        max_tokens=60,
        tools=[tool],
        tool_choice="required",
    )
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and isinstance(json.loads(tc.function.arguments)["city"], str)

    comp = client.completions.create(
        model="smollm2",
        prompt=STORY,
        max_tokens=20,
        temperature=0.8,
        seed=3,
        extra_body={"guided_choice": ["fly", "swim", "dig"]},
    )
    assert comp.choices[0].text in ("fly", "swim", "dig")
    assert wait_until(lambda: not any(instance_blocks(stack).values()), 5), instance_blocks(stack)


def test_echo_with_logprobs_returns_the_prompts_logprobs(stack, reference_engine, tokenizer):
    """The prefill instance computes the prompt's logprobs (chunk by chunk) and sends them with the first token:
    echo + logprobs puts them before the completion's, equal to the single engine's."""
    from spindle_engine import SamplingParams

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused")
    prompt = tokenizer.encode(STORY, add_special_tokens=False)
    resp = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = resp.choices[0].logprobs
    reference_engine.add_request(
        "ref-echo", prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, logprobs=2)
    )
    ref_prompt, ref_out = None, []
    while reference_engine.has_unfinished():
        for o in reference_engine.step():
            if o.request_id == "ref-echo":
                ref_prompt = ref_prompt or o.prompt_logprobs
                ref_out += o.logprobs or []
    assert resp.choices[0].text.startswith(STORY)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 4
    want = [x.logprob for x in ref_prompt] + [x.logprob for x in ref_out]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=LOGPROB_TOL)
    assert lp.tokens[: len(prompt)] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
