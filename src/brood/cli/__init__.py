"""The `brood` command line."""
