"""The `staleflow` command: one module per command group (typer)."""
