"""LoongServe (SOSP'24): elastic sequence parallelism over one pool of elastic instances."""

from .strategy import LoongServeStrategy

__all__ = ["LoongServeStrategy"]
