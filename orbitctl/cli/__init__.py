"""The Typer command line: one thin module per command; output.py is the only module that prints."""
