"""Fixtures for the infra tests: tiny assets built once per session with very small models."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.assets import AssetPaths, TinyModelSpec, build_tiny_assets

# Small enough that a forward pass is ~1 ms: the tests check plumbing and direction, not quality.
TEST_SPEC = TinyModelSpec(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32
)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> AssetPaths:
    """Tokenizers, tiny models and the addition dataset, built once into a session tmp dir."""
    root: Path = tmp_path_factory.mktemp("tiny-assets")
    return build_tiny_assets(root, seed=0, policy=TEST_SPEC, reward=TEST_SPEC)
