"""Errors the engine's callers treat alike, wherever they come from."""


class EngineFatal(RuntimeError):
    """The engine cannot go on: a peer of its parallel group (a TP rank, a pipeline stage) is gone, timed out or
    diverged. The engine thread stops at the first one, also when a call (not a step) raised it."""
