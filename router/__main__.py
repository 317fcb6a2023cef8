"""`python -m router` runs the `kvpush` command line."""

from router.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
