"""The benchmarks' end-to-end tests train on the integration tests' tiny synthetic dataset."""

from tests.integration.conftest import data_dir  # noqa: F401  (a fixture, used by name)
