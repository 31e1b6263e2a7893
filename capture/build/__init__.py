"""Rebuilding a rollout: prefix merging, the contiguous projection, the final answer."""
