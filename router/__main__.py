"""`python -m router [serve] [options]` runs the router (`kvpush serve`)."""

from router.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
