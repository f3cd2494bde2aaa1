"""Errors of the data plane."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed, timed out, was cancelled or was refused; the process group stays usable."""


class HeaderMismatchError(TransferError, ValueError):
    """The header the sender sent is not exactly the one the receiver expected; no payload moved."""
