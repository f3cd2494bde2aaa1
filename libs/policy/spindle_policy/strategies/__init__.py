"""Built-in strategies; importing this package registers them."""

from . import chunked, csps, fixed_sp, loongserve, medha, request_sp, seesaw, single, spindle, tetris  # noqa: F401
