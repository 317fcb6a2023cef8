"""Integration tests on real processes: every test here is marked `integration`; `vllm` tests skip, saying why,
when the engine is not installed; `tiny_model_dir` is the cached tiny model (built once per cache folder)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.integration.support import tiny_model

HERE = Path(__file__).resolve().parent
ENGINE_PACKAGES = ("vllm", "nixl")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [name for name in ENGINE_PACKAGES if importlib.util.find_spec(name) is None]
    for item in items:
        if not item.path.is_relative_to(HERE):
            continue
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration)
        if missing and item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)} (installed by `make test`)"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model in the shared test cache; reused across runs thanks to its stamp."""
    pytest.importorskip("transformers", reason="building the model needs torch and transformers")
    return tiny_model()
