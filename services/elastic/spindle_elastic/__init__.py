"""Spindle elastic (colocated) instance (`python -m spindle_elastic`)."""

import os

# Before torch loads GNU OpenMP: see spindle_prefill/__init__.py (spinning threads steal a small machine's cores
# from the gateway and the other services). Set it yourself to override.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .instance import ElasticInstance

__all__ = ["ElasticInstance"]
