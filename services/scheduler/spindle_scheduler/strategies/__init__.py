"""Built-in strategies; importing this package registers them."""

from . import single  # noqa: F401
