"""Typed actions a strategy returns; the executor (NATS shell or simulator) carries them out."""

from __future__ import annotations

from dataclasses import dataclass

from spindle_protocol.messages import RequestSpec


@dataclass(frozen=True)
class Admit:
    request_id: str
    prefill_instance: str
    decode_instance: str


@dataclass(frozen=True)
class Reject:
    request_id: str
    status: int  # 429 overload, 503 no live workers, 400 bad request
    reason: str
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class RunPrefill:
    """Prefill `spec` on `prefill_instance`; its KV goes to `decode_instance` (or parks in `kvstore_instance`)."""

    spec: RequestSpec
    prefill_instance: str
    decode_instance: str
    kvstore_instance: str = ""


@dataclass(frozen=True)
class FailRequest:
    """End the request with an error everywhere (stream error to the gateway, abort to every instance)."""

    request_id: str
    status: int
    message: str


Action = Admit | Reject | RunPrefill | FailRequest
