"""``python -m bench.headline``."""

from bench.headline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
