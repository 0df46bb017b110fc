"""Fixtures: see tests/unit/torch_fixtures.py."""

from tests.unit.torch_fixtures import MODELS, data_dir, make_engine  # noqa: F401
