"""Spindle's own strategy: per request, the cheapest prefill plan that meets its deadline; batch work on idle time."""

from .strategy import SpindleStrategy

__all__ = ["SpindleStrategy"]
