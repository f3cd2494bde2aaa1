"""Spindle gateway: OpenAI-compatible REST + SSE in front of the NATS control plane.

Exports resolve lazily, so that `python -m spindle_gateway --help` does not import the tokenizer stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"GatewayConfig": ".config", "GatewayState": ".state", "create_app": ".app"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
