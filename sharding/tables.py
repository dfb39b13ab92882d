"""Tables as text, for terminals, logs and README-ready reports.

Pure Python, so every layer may use it: `sharding` is the lowest one, and
`input_pipeline`, `detector` and `benchmarks` all import from it. Callers
format their own cells (units, rounding); these functions only lay them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cells(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[list[str]]:
    """[header, *rows] as strings; ValueError when a row's length differs from the header's."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"table row {list(row)!r} has {len(row)} cells for {len(header)} columns")
    return [[str(cell) for cell in row] for row in (header, *rows)]


def markdown_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table: `| a | b |`, a `|---|---|` rule, then one `| .. |` line per row.

    Args:
      header: column names.
      rows: one sequence of cells per row, as many as `header`; cells are
        written as str(cell).

    Raises:
      ValueError: a row has more or fewer cells than the header.
    """
    header_cells, *row_cells = _cells(header, rows)
    lines = ["| " + " | ".join(header_cells) + " |", "|" + "---|" * len(header_cells)]
    lines += ["| " + " | ".join(cells) + " |" for cells in row_cells]
    return "\n".join(lines)


def aligned_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """Plain text in aligned columns, two spaces apart, a dashed rule under the header.

    The first column (names) is left-justified, the others (numbers)
    right-justified; each column is as wide as its widest cell.

    Raises:
      ValueError: a row has more or fewer cells than the header.
    """
    cells = _cells(header, rows)
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
