"""`python -m kvpush` runs the `kvpush` command line."""

from kvpush.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
