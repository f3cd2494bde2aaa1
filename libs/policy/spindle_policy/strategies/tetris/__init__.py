"""Tetris (CDSP, seed 000): chunkwise dynamic sequence parallelism on a prefill/decode-disaggregated cluster.

`planner.py` is the paper's Algorithms 1-3 and Eq. 2, `groups.py` its node-aware GetGroup, `rate.py` the
load-aware improvement rate, `strategy.py` the registered strategy `tetris`.
"""

from .strategy import TetrisStrategy

__all__ = ["TetrisStrategy"]
