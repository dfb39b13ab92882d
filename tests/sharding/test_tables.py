"""The one table layout every report uses (benchmarks, step plans, conversion counts, COCO metrics)."""

import pytest

from sharding.tables import aligned_table, markdown_table


def test_markdown_table_layout():
    table = markdown_table(["name", "n"], [("a", 1), ("bb", 2.5)])
    assert table == "| name | n |\n|---|---|\n| a | 1 |\n| bb | 2.5 |"


def test_markdown_table_without_rows_is_header_and_rule():
    assert markdown_table(("x", "y", "z"), []) == "| x | y | z |\n|---|---|---|"


def test_aligned_table_left_aligns_names_and_right_aligns_numbers():
    table = aligned_table(["class", "AP"], [("cat", "0.300"), ("a long name", "-")])
    assert table.splitlines() == [
        "class           AP",
        "-----------  -----",
        "cat          0.300",
        "a long name      -",
    ]


@pytest.mark.parametrize("render", [markdown_table, aligned_table])
def test_a_row_with_the_wrong_number_of_cells_is_an_error(render):
    with pytest.raises(ValueError, match=r"has 3 cells for 2 columns"):
        render(["a", "b"], [(1, 2), (1, 2, 3)])
