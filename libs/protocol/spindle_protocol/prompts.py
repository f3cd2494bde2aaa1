"""Prompt token arrays on the control plane: inline when small, else the JetStream object store.

A prompt of hundreds of thousands of tokens does not fit one NATS message (1 MB by default), so the
gateway stores it as little-endian int32 under the request id and sends a `PromptRef`; a worker loads it
and checks the digest. The model's context is then the only limit on prompt length.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from nats.js.api import ObjectStoreConfig

from .bus import Bus
from .messages import Prompt, PromptRef
from .subjects import PROMPT_BUCKET

INLINE_MAX_TOKENS = 32_768  # msgpack ints take <= 5 bytes: 32k tokens stay well under one 1 MB message


def _to_bytes(token_ids: list[int]) -> bytes:
    arr = array("i", token_ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _from_bytes(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"prompt object of {len(data)} bytes is not a whole number of int32 tokens")
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


async def _store(bus: Bus):
    return await bus.js.create_object_store(PROMPT_BUCKET, config=ObjectStoreConfig(bucket=PROMPT_BUCKET))


async def put_prompt(
    bus: Bus, request_id: str, token_ids: list[int], inline_max_tokens: int = INLINE_MAX_TOKENS
) -> Prompt:
    """The gateway's side: a `Prompt` that travels in control messages whatever its length."""
    if len(token_ids) <= inline_max_tokens:
        return Prompt(num_tokens=len(token_ids), token_ids=list(token_ids))
    data = _to_bytes(token_ids)
    store = await _store(bus)
    await store.put(request_id, data)
    ref = PromptRef(
        bucket=PROMPT_BUCKET, name=request_id, num_tokens=len(token_ids), sha256=hashlib.sha256(data).hexdigest()
    )
    return Prompt(num_tokens=len(token_ids), ref=ref)


async def load_prompt(bus: Bus, prompt: Prompt) -> list[int]:
    """A worker's side: the token ids, checked against the count and digest the gateway recorded."""
    if prompt.token_ids is not None:
        if len(prompt.token_ids) != prompt.num_tokens:
            raise ValueError(f"prompt says {prompt.num_tokens} tokens but carries {len(prompt.token_ids)}")
        return list(prompt.token_ids)
    if prompt.ref is None:
        raise ValueError("prompt has neither token ids nor an object-store reference")
    ref = prompt.ref
    store = await bus.js.object_store(ref.bucket)
    result = await store.get(ref.name)
    data = result.data or b""
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"prompt object {ref.name} does not match its digest")
    tokens = _from_bytes(data)
    if len(tokens) != ref.num_tokens:
        raise ValueError(f"prompt object {ref.name} has {len(tokens)} tokens, expected {ref.num_tokens}")
    return tokens


async def delete_prompt(bus: Bus, prompt: Prompt) -> None:
    """Drop a stored prompt once the request has ended (no-op for inline prompts)."""
    if prompt.ref is None:
        return
    try:
        store = await bus.js.object_store(prompt.ref.bucket)
        await store.delete(prompt.ref.name)
    except Exception:  # already gone: deleting is idempotent
        pass
