"""The `tokcap` command and the local pipeline it can start (demo, child processes)."""
