"""Spindle prefill instance (`python -m spindle_prefill`)."""

from .instance import PrefillInstance

__all__ = ["PrefillInstance"]
