"""The gateway's settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    served_model_name: str  # the `model` clients send and see
    model: str  # what --model named (reported as `root` in /v1/models)
    max_model_len: int  # prompt + output tokens; the cluster's own limit, if smaller, wins at run time
    vocab_size: int  # token ids accepted in prompts and stop_token_ids: [0, vocab_size)
    request_timeout: float = 600.0  # seconds from arrival to the request's deadline
    max_stop_strings: int = 32
    admit_timeout: float = 5.0  # seconds to wait for the scheduler's admission reply
    status_max_age: float = 0.5  # /health and /metrics reuse a ClusterStatus this fresh
    disconnect_poll: float = 0.2  # seconds between client-disconnect checks while no token arrives

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be non-empty")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        for name in ("admit_timeout", "status_max_age", "disconnect_poll"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
