"""The gateway's settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

MIN_BODY_BYTES = 4 << 20
BODY_BYTES_PER_TOKEN = 16


def default_max_body_bytes(max_model_len: int) -> int:
    """Room for a request whose prompt fills the context, and not much more: the body is read before anything
    else, so this bounds what one request can make the gateway hold.

    Text is typically 3-5 bytes a token (up to about 12 when a client JSON-escapes non-ASCII text) and a token id
    in a JSON list at most 8 (`123456, `): 16 bytes a token fits the whole context either way. The 4 MiB floor
    keeps room for long stop lists and message overhead on small contexts while capping what a 10 MB body costs.
    """
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


@dataclass(frozen=True)
class GatewayConfig:
    served_model_name: str  # the `model` clients send and see
    model: str  # what --model named (reported as `root` in /v1/models)
    max_model_len: int  # prompt + output tokens; the cluster's own limit, if smaller, wins at run time
    vocab_size: int  # token ids accepted in prompts and stop_token_ids: [0, vocab_size)
    request_timeout: float = 600.0  # seconds from arrival to the request's deadline
    max_stop_strings: int = 32
    admit_timeout: float = 5.0  # seconds to wait for the scheduler's admission reply
    scheduler_wait: float = 15.0  # with no scheduler running (restarting), admissions wait this long for one
    status_max_age: float = 0.5  # /health and /metrics reuse a ClusterStatus this fresh
    disconnect_poll: float = 0.2  # seconds between client-disconnect checks while no token arrives
    default_max_tokens: int | None = None  # chat requests without max_tokens: at most this (None: fill the context)
    max_body_bytes: int | None = None  # larger request bodies are a 413 unread; None: default_max_body_bytes()
    batch_db: str | None = None  # the Batch API's SQLite file (files, batches, results); None: no Batch API
    batch_max_file_bytes: int = 200 << 20  # the largest upload to /v1/files
    batch_max_lines: int = 50_000  # requests per batch
    batch_concurrency: int = 16  # batch lines in flight at once, over all batches
    dashboard: bool = True  # /dashboard and /v1/spindle/timeline: the gateway follows the cluster's events too

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
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be positive, got {self.default_max_tokens}")
        if self.scheduler_wait < 0:
            raise ValueError(f"scheduler_wait must be >= 0, got {self.scheduler_wait}")
        for name in ("admit_timeout", "status_max_age", "disconnect_poll"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("batch_max_file_bytes", "batch_max_lines", "batch_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    @property
    def body_limit(self) -> int:
        """The largest request body accepted, in bytes."""
        return self.max_body_bytes if self.max_body_bytes is not None else default_max_body_bytes(self.max_model_len)
