"""Spindle data plane: header-checked point-to-point tensor transfers over torch.distributed."""

from .dataplane import DataPlane
from .errors import HeaderMismatchError, TransferError
from .wire import DTYPES, dtype_name, header_of

__all__ = ["DTYPES", "DataPlane", "HeaderMismatchError", "TransferError", "dtype_name", "header_of"]
