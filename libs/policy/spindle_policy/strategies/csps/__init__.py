"""CSPS: SP prefill with communication-efficient sparse attention (CSA), its configuration, and Q-moving decode."""

from .strategy import CSPSStrategy

__all__ = ["CSPSStrategy"]
