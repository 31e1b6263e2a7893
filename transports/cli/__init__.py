"""The `tokcap worker`, `submit` and `inspect` commands."""
