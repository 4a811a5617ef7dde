"""CLI commands, one module each; every module exports ``COMMANDS`` (a list of click commands)."""
