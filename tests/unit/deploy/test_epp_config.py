"""The EPP config we ship (components/inference-pool/epp-config.yaml) against what the pinned llm-d-router release
accepts, as its source says (tests/unit/deploy/llm_d_router.py: llm-d-router v0.10.0, commit 71f4f09, file by
file): registered plugin types, each plugin's declared parameter fields (the EPP decodes them strictly), plugin
references that must name declared plugins (a P/D profile handler's decider), one profile handler, the config's
apiVersion and kind. The config kvpush shipped before (for llm-d-inference-scheduler v0.6.0) fails here as the EPP
fails it; a config that only renders with kustomize proves nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from router.gateway import PREFILLER_HEADER
from tests.unit.deploy import llm_d_router as llm_d
from tests.unit.deploy.kustomize import INFERENCE_POOL

CONFIG = INFERENCE_POOL / "epp-config.yaml"
Config = dict[str, Any]

# kvpush's epp-config.yaml up to 617df9d (written for llm-d-inference-scheduler v0.6.0), verbatim but comments.
OLD_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: prefill-header-handler
  - type: prefill-filter
  - type: decode-filter
  - type: prefix-cache-scorer
  - type: queue-scorer
  - type: max-score-picker
  - type: pd-profile-handler
    parameters:
      threshold: 0
schedulingProfiles:
  - name: prefill
    plugins:
      - pluginRef: prefill-filter
      - pluginRef: queue-scorer
        weight: 1
      - pluginRef: prefix-cache-scorer
        weight: 2
      - pluginRef: max-score-picker
  - name: decode
    plugins:
      - pluginRef: decode-filter
      - pluginRef: prefix-cache-scorer
        weight: 2
      - pluginRef: max-score-picker
"""


def _plugin_problems(spec: Config, declared: dict[str, str], allow_experimental: bool) -> list[str]:
    name, kind = spec.get("name", spec.get("type")), spec.get("type")
    problems = [f"plugin {name}: key {k!r} is not a PluginSpec field" for k in set(spec) - llm_d.PLUGIN_SPEC_KEYS]
    plugin = llm_d.PLUGINS.get(str(kind))
    if plugin is None:
        return [*problems, f"plugin {name}: type {kind!r} is not registered in {llm_d.RELEASE}"]
    if plugin.deprecated:
        problems.append(f"plugin {name}: {kind} is deprecated since {plugin.deprecated}")
    if plugin.stability is llm_d.Stability.ALPHA and not allow_experimental:
        problems.append(f"plugin {name}: {kind} is alpha (needs --allow-experimental-plugins)")
    parameters = spec.get("parameters")
    if parameters is not None and plugin.parameters is llm_d.PARAMETERS_IGNORED:
        problems.append(f"plugin {name}: {kind} takes no parameters")
    elif parameters is not None and plugin.parameters is not None:
        schemas = (plugin.parameters, *plugin.alternatives)
        unknown = [llm_d.unknown_fields(parameters, fields) for fields in schemas]
        if all(unknown):
            problems.append(f"plugin {name}: unknown parameters {unknown[0]} (strict decoding)")
    for path, role in sorted(plugin.refs.items()):
        ref = llm_d.ref_value(parameters, path) or plugin.ref_defaults.get(path)
        if ref and ref not in declared:
            problems.append(f"plugin {name}: {path} names {ref!r}, which is not declared")
        elif ref and (declared[ref] not in llm_d.PLUGINS or llm_d.PLUGINS[declared[ref]].role is not role):
            problems.append(f"plugin {name}: {path} names {ref!r}, which is no {role}")
    return problems


def problems(config: Config, allow_experimental: bool = False) -> list[str]:
    """Why the pinned EPP would refuse this config (or log it as deprecated); empty: it loads it as is."""
    found = [f"key {k!r} is not an EndpointPickerConfig field" for k in set(config) - llm_d.CONFIG_KEYS]
    if config.get("apiVersion") in llm_d.DEPRECATED_API_VERSIONS:
        found.append(f"apiVersion {config.get('apiVersion')} is deprecated: {llm_d.API_VERSION}")
    elif config.get("apiVersion") != llm_d.API_VERSION:
        found.append(f"apiVersion {config.get('apiVersion')!r} is not {llm_d.API_VERSION}")
    if config.get("kind") != llm_d.KIND:
        found.append(f"kind {config.get('kind')!r} is not {llm_d.KIND}")
    specs = config.get("plugins") or []
    names = [s.get("name", s.get("type")) for s in specs]
    found += [f"plugin name {n!r} is declared twice" for n in sorted({n for n in names if names.count(n) > 1})]
    declared = {str(n): str(s.get("type")) for n, s in zip(names, specs, strict=True)}
    for spec in specs:
        found += _plugin_problems(spec, declared, allow_experimental)
    handlers = [
        n for n, t in declared.items() if t in llm_d.PLUGINS and llm_d.PLUGINS[t].role is llm_d.Role.PROFILE_HANDLER
    ]
    if len(handlers) != 1:
        found.append(f"{len(handlers)} profile handlers ({handlers}): exactly one is allowed")
    for profile in config.get("schedulingProfiles") or []:
        found += [f"profile key {k!r} is not a SchedulingProfile field" for k in set(profile) - llm_d.PROFILE_KEYS]
        for ref in profile.get("plugins") or []:
            found += [f"profile {profile.get('name')}: key {k!r}" for k in set(ref) - llm_d.PROFILE_PLUGIN_KEYS]
            if ref.get("pluginRef") not in declared:
                found.append(f"profile {profile.get('name')} references undefined plugin {ref.get('pluginRef')!r}")
    return found


@pytest.fixture
def shipped() -> Config:
    return dict(yaml.safe_load(CONFIG.read_text()))


def test_the_shipped_config_is_what_the_pinned_epp_accepts(shipped: Config) -> None:
    assert problems(shipped) == []


def test_the_config_kvpush_shipped_before_is_refused() -> None:
    found = problems(yaml.safe_load(OLD_CONFIG))
    assert "plugin pd-profile-handler: unknown parameters ['threshold'] (strict decoding)" in found  # #1134
    assert (
        "plugin pd-profile-handler: deciderPluginName names 'prefix-based-pd-decider', which is not declared" in found
    )  # #531
    assert any("apiVersion inference.networking.x-k8s.io/v1alpha1 is deprecated" in p for p in found)
    assert any("prefill-header-handler is deprecated" in p for p in found)


def _set(path: str, value: Any) -> Callable[[Config], None]:
    def change(config: Config) -> None:
        *parents, last = path.split("/")
        node: Any = config
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value

    return change


def _plugin(kind: str) -> Callable[[Config], Config]:
    return lambda config: next(p for p in config["plugins"] if p["type"] == kind)


def _drop(kind: str) -> Callable[[Config], None]:
    return lambda config: config["plugins"].remove(_plugin(kind)(config))


MUTATIONS: dict[str, Callable[[Config], None]] = {
    "the old apiVersion": _set("apiVersion", "inference.networking.x-k8s.io/v1alpha1"),
    "a misspelt top-level key": _set("schedulingProfile", []),
    "an unregistered type": lambda c: c["plugins"].append({"type": "prefill-headers-handler"}),
    "an unknown parameter": lambda c: _plugin("disagg-profile-handler")(c)["parameters"].update(threshold=0),
    "a misspelt nested parameter": lambda c: _plugin("disagg-profile-handler")(c)["parameters"].update(
        deciders={"prefil": "always-disagg-pd-decider"}
    ),
    "both parameter forms at once": lambda c: _plugin("disagg-profile-handler")(c)["parameters"].update(
        deciderPluginName="always-disagg-pd-decider"
    ),
    "parameters a filter ignores": lambda c: _plugin("decode-filter")(c).update(parameters={"label": "x"}),
    "a producer's unknown field": lambda c: _plugin("approx-prefix-cache-producer")(c)["parameters"].update(
        hashSeed="1"
    ),
    "the decider not declared": _drop("always-disagg-pd-decider"),
    "a decider that is no decider": lambda c: _plugin("disagg-profile-handler")(c)["parameters"].update(
        deciders={"prefill": "queue-scorer"}
    ),
    "a second profile handler": lambda c: c["plugins"].append({"type": "pd-profile-handler"}),
    "no profile handler": _drop("disagg-profile-handler"),
    "a profile's undeclared plugin": lambda c: c["schedulingProfiles"][1]["plugins"].append({"pluginRef": "x"}),
    "a duplicate name": lambda c: c["plugins"].append({"type": "queue-scorer"}),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_config_the_epp_would_refuse_fails(shipped: Config, mutation: str) -> None:
    broken = copy.deepcopy(shipped)
    MUTATIONS[mutation](broken)
    assert problems(broken), f"{mutation}: not caught"


def test_the_table_cites_its_source() -> None:
    assert llm_d.REPO == "github.com/llm-d/llm-d-router" and llm_d.RELEASE == "v0.10.0"
    assert len(llm_d.COMMIT) == 40
    for kind, plugin in llm_d.PLUGINS.items():
        assert plugin.source.startswith("pkg/epp/framework/plugins/") and plugin.source.endswith(".go"), kind


def test_every_request_gets_a_decode_and_a_prefill_pick_named_in_the_header_the_sidecar_reads(shipped: Config) -> None:
    declared = {p.get("name", p["type"]): p for p in shipped["plugins"]}
    (handler,) = [p for p in shipped["plugins"] if p["type"] == "disagg-profile-handler"]
    decider = handler["parameters"]["deciders"]["prefill"]
    assert declared[decider]["type"] == "always-disagg-pd-decider"  # the sidecar's decider may still skip prefill
    assert handler["parameters"].get("stageOrder", "decode-first") == "decode-first"
    profiles = {
        p["name"]: [declared[r["pluginRef"]]["type"] for r in p["plugins"]] for p in shipped["schedulingProfiles"]
    }
    assert set(profiles) == {"prefill", "decode"}  # the handler's default profile names
    assert "prefill-filter" in profiles["prefill"] and "decode-filter" in profiles["decode"]
    for kinds in profiles.values():
        assert [llm_d.PLUGINS[k].role for k in kinds].count(llm_d.Role.PICKER) == 1
    # A decode pod's port is the sidecar: its /metrics has no vLLM queue gauges for load scorers to read.
    assert not {"queue-scorer", "kv-cache-utilization-scorer"} & set(profiles["decode"])
    assert PREFILLER_HEADER == llm_d.PREFILL_HEADER  # what disagg-profile-handler's PreRequest writes


def test_the_table_s_checks_hold_for_its_own_sample() -> None:
    """llm-d-router's own deploy/config/pd-epp-config.yaml @v0.10.0 (its plugins and parameters) passes."""
    sample = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "type": "approx-prefix-cache-producer",
                "parameters": {"maxPrefixTokensToMatch": 16384, "lruCapacityPerServer": 31250},
            },
            {"type": "prefix-cache-scorer"},
            {"type": "queue-scorer"},
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "max-score-picker"},
            {"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}}},
            {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 16}},
        ],
        "schedulingProfiles": [
            {"name": name, "plugins": [{"pluginRef": f"{name}-filter"}, {"pluginRef": "max-score-picker"}]}
            for name in ("prefill", "decode")
        ],
    }
    assert problems(sample) == []
