"""Benchmarks behind `make bench`: each section measures one part of Baton and rewrites its own part of
docs/BENCHMARKS.md (see `benchmarks.run`)."""
