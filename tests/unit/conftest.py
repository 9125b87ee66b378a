"""Fixtures of the unit tests that load the router's real MiniLM (once for the session)."""

from __future__ import annotations

import pytest

from config import RouterConfig


@pytest.fixture(scope="session")
def extractor():
    """The router's feature extractor with the default config (onnx int8 MiniLM, py3langid), warm."""
    from router.features import FeatureExtractor

    fx = FeatureExtractor(RouterConfig())
    fx.embed(["warm up"])
    return fx
