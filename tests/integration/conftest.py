"""Integration tests on real processes: every test here is marked `integration`; `vllm` tests skip, saying why,
when the engine is not installed; `tiny_model_dir` is the cached tiny model (built once per cache folder).

Engine families are shared (tests/integration/families.py): `family_pool` is the session's pool, tests marked
`family(SPEC)` run next to the other tests of that family (the ones marked `spoils=True` last), and the family is
given back once the group's last test and its module's fixtures are done, before anything else runs.

Every router a test starts (directly, in a stack or a bench suite) closes its listener at once on SIGTERM
(KVPUSH_DRAIN_DELAY=0, `quick_router_stops`) instead of after the default 3 s: a stop is a wait on that timer, and
the suite stops some sixty routers. The tests of the drain itself pass --drain-delay, which wins.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Generator, Hashable, Iterator
from pathlib import Path

import pytest

from tests.integration.families import FamilyPool, order_by_family, start
from tests.integration.support import tiny_model

HERE = Path(__file__).resolve().parent
ENGINE_PACKAGES = ("vllm", "nixl")
POOL = pytest.StashKey[FamilyPool]()
STARTS = pytest.StashKey[list[str]]()  # every shared family start of the session, by label


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "family(spec, spoils=False): runs on the shared engine family `spec` (tests/integration/families)"
    )


def family_of(item: pytest.Item) -> tuple[Hashable | None, bool]:
    """The item's family key and whether it spoils the family (from its `family` mark), or (None, False)."""
    mark = item.get_closest_marker("family")
    if mark is None:
        return None, False
    return mark.args[0], bool(mark.kwargs.get("spoils", False))


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by (parametrized) higher-scoped fixtures
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [name for name in ENGINE_PACKAGES if importlib.util.find_spec(name) is None]
    for item in items:
        if not item.path.is_relative_to(HERE):
            continue
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration)
        if missing and item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)} (installed by `make test`)"))
    order = order_by_family([family_of(item) for item in items])
    items[:] = [items[i] for i in order]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Once the last test of a family's group is torn down (its module's fixtures too), stop the family."""
    try:
        return (yield)
    finally:
        pool = item.config.stash.get(POOL, None)
        if pool is not None and (nextitem is None or family_of(nextitem)[0] != family_of(item)[0]):
            pool.release()


@pytest.fixture(scope="session", autouse=True)
def quick_router_stops() -> Iterator[None]:
    """Routers started by this session inherit KVPUSH_DRAIN_DELAY=0 (unless the caller's environment sets it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPUSH_DRAIN_DELAY", os.environ.get("KVPUSH_DRAIN_DELAY", "0"))
        yield


@pytest.fixture(scope="session")
def family_pool(pytestconfig: pytest.Config) -> Iterator[FamilyPool]:
    """The session's engine families, one live at a time."""
    with FamilyPool(start) as pool:
        pytestconfig.stash[POOL] = pool
        pytestconfig.stash[STARTS] = pool.starts
        yield pool
        del pytestconfig.stash[POOL]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """How many shared engine families the session started (each is about a minute of both cores)."""
    starts = config.stash.get(STARTS, None)
    if starts:
        terminalreporter.write_line(f"shared engine families started: {len(starts)} ({', '.join(starts)})")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model in the shared test cache; reused across runs thanks to its stamp."""
    pytest.importorskip("transformers", reason="building the model needs torch and transformers")
    return tiny_model()
