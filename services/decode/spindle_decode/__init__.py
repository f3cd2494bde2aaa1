"""Spindle decode instance (`python -m spindle_decode`)."""

import os

# Before torch loads GNU OpenMP: its threads spin 300k rounds after every parallel op by default, which steals
# the cores that the other engine processes of a small machine need (bench_serve load: 0.37 -> 1.03 req/s with
# 2 prefill + 1 decode on 2 cores; a lone batch-1 decode step is unchanged). Set it yourself to override.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .instance import DecodeInstance

__all__ = ["DecodeInstance"]
