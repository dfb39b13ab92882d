"""The documentation's scripts: `python -m docs.figures` draws its pictures (not part of the installed package)."""
