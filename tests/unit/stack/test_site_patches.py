"""stack/site/sitecustomize.py: the NIXL config defaults and the import hook, on our own stand-in modules."""

from __future__ import annotations

import enum
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SITE = Path(__file__).resolve().parents[3] / "stack" / "site" / "sitecustomize.py"


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The harness module loaded under a private name with both switches off (so it installs nothing)."""
    monkeypatch.delenv("KVPUSH_NIXL_NO_PROG_THREAD", raising=False)
    monkeypatch.delenv("KVPUSH_KEEP_AFFINITY", raising=False)
    monkeypatch.delenv("KVPUSH_NIXL_PTHR_DELAY_US", raising=False)
    spec = importlib.util.spec_from_file_location("kvpush_site_under_test", SITE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_nixl_api() -> ModuleType:
    """Same shape as nixl's `_api`: an enum of sync modes and a config class with these keyword defaults."""

    class SyncMode(enum.Enum):
        NIXL_THREAD_SYNC_NONE = 0
        NIXL_THREAD_SYNC_STRICT = 1
        NIXL_THREAD_SYNC_RW = 2

    class Config:
        def __init__(
            self,
            enable_prog_thread: bool = True,
            enable_listen_thread: bool = False,
            num_threads: int = 0,
            sync_mode: SyncMode | None = None,
        ) -> None:
            self.enable_pthread = enable_prog_thread
            self.num_threads = num_threads
            self.sync_mode = sync_mode

    api = ModuleType("fake_api")
    api.nixl_agent_config = Config  # type: ignore[attr-defined]
    api.nixl_thread_sync_t = SyncMode  # type: ignore[attr-defined]
    return api


class TestAgentConfigDefaults:
    def test_vllm_style_call_gets_no_progress_thread_and_strict_sync(self, site: ModuleType) -> None:
        api = fake_nixl_api()
        site._patch_agent_config(api)
        config = api.nixl_agent_config(num_threads=4)
        assert config.enable_pthread is False
        assert config.sync_mode is api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        assert config.num_threads == 4

    def test_explicit_choices_are_kept_positional_or_keyword(self, site: ModuleType) -> None:
        api = fake_nixl_api()
        site._patch_agent_config(api)
        rw = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
        assert api.nixl_agent_config(True).enable_pthread is True
        assert api.nixl_agent_config(enable_prog_thread=True).enable_pthread is True
        assert api.nixl_agent_config(sync_mode=rw).sync_mode is rw

    def test_bad_arguments_still_fail_like_the_original(self, site: ModuleType) -> None:
        api = fake_nixl_api()
        site._patch_agent_config(api)
        with pytest.raises(TypeError):
            api.nixl_agent_config(no_such_option=1)


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("kvpush_fake_pkg")]:
            del sys.modules[name]


def test_import_hook_patches_only_the_named_module_after_it_ran(site: ModuleType, module_dir: Path) -> None:
    pkg = module_dir / "kvpush_fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_api.py").write_text("VALUE = 'original'\n")
    (pkg / "other.py").write_text("VALUE = 'original'\n")
    seen: list[str] = []

    def patch(module: ModuleType) -> None:
        seen.append(module.__dict__["VALUE"])
        module.__dict__["VALUE"] = "patched"

    hook = site._PatchOnImport({"kvpush_fake_pkg._api"}, patch)
    sys.meta_path.insert(0, hook)
    try:
        api = importlib.import_module("kvpush_fake_pkg._api")
        other = importlib.import_module("kvpush_fake_pkg.other")
    finally:
        sys.meta_path.remove(hook)
    assert (api.VALUE, other.VALUE) == ("patched", "original")
    assert seen == ["original"]


def test_import_hook_ignores_modules_that_do_not_exist(site: ModuleType) -> None:
    hook = site._PatchOnImport({"kvpush_no_such_module"}, lambda module: None)
    assert hook.find_spec("kvpush_no_such_module", None) is None


class TestProgressThreadDelay:
    """KVPUSH_NIXL_PTHR_DELAY_US: every agent is built with that pthrDelay (NIXL's Python API hard-codes 0)."""

    @staticmethod
    def api_with_bindings(built: list[tuple[str, int]]) -> ModuleType:
        class AgentConfig:
            pthrDelay = 0

        def nixlAgent(name: str, config: AgentConfig) -> str:
            built.append((name, config.pthrDelay))
            return f"agent {name}"

        bindings = ModuleType("fake_bindings")
        bindings.nixlAgent = nixlAgent  # type: ignore[attr-defined]
        bindings.nixlAgentConfig = AgentConfig  # type: ignore[attr-defined]
        api = fake_nixl_api()
        api.nixlBind = bindings  # type: ignore[attr-defined]
        return api

    def test_agents_get_the_delay_and_both_switches_combine(self, site: ModuleType) -> None:
        built: list[tuple[str, int]] = []
        api = self.api_with_bindings(built)
        patches = site._nixl_patches({"KVPUSH_NIXL_PTHR_DELAY_US": "1000", "KVPUSH_NIXL_NO_PROG_THREAD": "1"})
        for patch in patches:
            patch(api)
        assert api.nixlBind.nixlAgent("a", api.nixlBind.nixlAgentConfig()) == "agent a"
        assert built == [("a", 1000)]
        assert api.nixl_agent_config().enable_pthread is False  # the other switch still applies

    @pytest.mark.parametrize("value", ["", "0", "-5", "soon"])
    def test_no_patch_without_a_positive_delay(self, site: ModuleType, value: str) -> None:
        assert site._nixl_patches({"KVPUSH_NIXL_PTHR_DELAY_US": value}) == []
