"""`python -m zeroscan` and the `zeroscan` console script (see zeroscan.cli)."""

from zeroscan.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
