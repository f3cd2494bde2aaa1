"""Built-in strategies; importing this package registers them."""

from . import chunked, fixed_sp, loongserve, request_sp, single, tetris  # noqa: F401
