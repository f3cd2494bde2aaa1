"""`python -m spindle_launcher up ...` is `spindle up ...`."""

from .cli import build_parser, main

__all__ = ["build_parser"]

if __name__ == "__main__":
    main()
