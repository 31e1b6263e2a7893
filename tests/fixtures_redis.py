"""Fixtures for a private redis-server per test session (filled in by the Redis transport)."""
