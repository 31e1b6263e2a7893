"""Helpers shared by the tests: servers, synthetic rollouts, fixtures, harness loops."""
