"""`python -m loadgen`: the same as the `loadgen` command."""

from loadgen.cli import main

raise SystemExit(main())
