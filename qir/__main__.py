"""``python -m qir`` and the ``qir`` console script."""

from qir.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
