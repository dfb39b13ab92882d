"""Modules stay short enough to read whole: a line limit per folder, held for every `.py` file under it."""

from __future__ import annotations

import pathlib

from tests.helpers import REPO_ROOT

# Folder -> the most lines a module under it may have.
LIMITS = {
    # Past this a module does several jobs: split it by role, as detectron2's packages are.
    **{folder: 700 for folder in ("detector", "input_pipeline", "sharding", "configs", "benchmarks", "tests")},
    # One module per checkpoint source and per step (files, renaming, checks, mapping, loading, the converter).
    "detector/models/weights": 499,
}


def oversized(root: pathlib.Path, limits=LIMITS) -> list[str]:
    """'path: N lines (limit L)' for every module over its folder's limit."""
    found = []
    for folder, limit in limits.items():
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root)}: {lines} lines (limit {limit})")
    return found


def test_modules_are_within_their_folders_line_limit():
    assert oversized(REPO_ROOT) == []


def test_every_limited_folder_has_modules(tmp_path):
    """The limits name folders that exist (not a renamed one), and a module over its limit is reported."""
    for folder in LIMITS:
        assert list((REPO_ROOT / folder).rglob("*.py")), folder
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "long.py").write_text("x = 1\n" * 3)
    assert oversized(tmp_path, {"package": 2}) == ["package/long.py: 3 lines (limit 2)"]
