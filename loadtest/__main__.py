"""`python -m loadtest`: hands argv to the CLI."""

from loadtest.cli import main

raise SystemExit(main())
