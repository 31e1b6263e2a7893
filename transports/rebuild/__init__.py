"""Rebuild jobs, the worker pool that runs them, and the results stream."""
