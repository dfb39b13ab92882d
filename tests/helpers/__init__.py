"""Helpers shared by the test modules."""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
