"""Fixtures that build every store, so contract tests run once per store."""
