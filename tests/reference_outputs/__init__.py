"""Stored outputs of other libraries' models (`generate.py` writes them; its docstring has the layout)."""
