"""`spindle sim [sweep | compare] ...`: which command runs (cli.py: one run and the sweep; compare.py: the
comparison)."""

from __future__ import annotations

import sys

from .cli import run_main, sweep_main
from .compare import compare_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:
        return sweep_main(argv[1:])
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
