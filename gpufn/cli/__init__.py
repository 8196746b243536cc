"""The `gpufn` command line: a thin typer edge over the library (no business logic here)."""
