"""Fixtures for the stack's tests on the real engine: the cached tiny model (built once per cache folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stack.engines import REPO_ROOT

CACHE = Path(os.environ.get("KVPUSH_TEST_CACHE", REPO_ROOT / ".cache" / "kvpush"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model in the shared test cache; reused across runs thanks to its stamp."""
    pytest.importorskip("transformers", reason="building the model needs torch and transformers")
    from stack.tiny_model import build

    return build(CACHE / "models" / "tiny", "tiny")
