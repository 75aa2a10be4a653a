"""Helpers for this project's tests and benchmarks: the multi-rank launcher, real engines, the
plain-torch references. Not part of the public API: run from a source checkout (``make test``)."""
