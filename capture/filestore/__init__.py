"""The node-local file store: one append-only, fsynced log per rollout."""
