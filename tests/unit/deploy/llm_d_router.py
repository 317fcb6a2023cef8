"""What llm-d's endpoint picker accepts in an EndpointPickerConfig, written down from its source: llm-d-router
v0.10.0 (github.com/llm-d/llm-d-router, tag v0.10.0, commit 71f4f0999f95b96c49a9d0c4afbd18dfdb943c26, the
newest release; llm-d v0.9.0 bundles it). Data, not a schema of our own: each entry cites the file it was read
from. What the EPP does with a config (pkg/epp/config/loader/configloader.go @v0.10.0):

- the document is decoded strictly (`serializer.EnableStrict`): an unknown top-level, plugin or profile key is an
  error; its apiVersion is `llm-d.ai/v1alpha1` (apix/config/v1alpha1), or the deprecated
  `inference.networking.x-k8s.io/v1alpha1` (logged);
- each plugin's `parameters` go to its factory through `plugin.StrictDecoder` (DisallowUnknownFields, since
  v0.9.0, llm-d-router#1134; pkg/epp/framework/interface/plugin/registry.go): a field its parameter struct does
  not declare is an error. Factories that take `_ *json.Decoder` never read theirs (`PARAMETERS_IGNORED`): we
  refuse parameters there too, since they would do nothing;
- a plugin's name defaults to its type (loader/defaults.go); names are unique, types registered, every profile's
  `pluginRef` declared (loader/validation.go); parameters that name other plugins (`pluginRef` tags) must name
  declared plugins (`buildPluginDAG`: "a dependency on the unregistered plugin"); exactly one profile handler;
- `pd-profile-handler`'s `deciderPluginName` defaults to `prefix-based-pd-decider`, which must be declared
  (llm-d-router#531, since v0.6.0: "invalid decider plugin type");
- plugins of Alpha stability need `--allow-experimental-plugins` (`ValidatePluginStability`).
The EPP image is ghcr.io/llm-d/llm-d-router-endpoint-picker since llm-d-router#1098 (Makefile `EPP_IMAGE_NAME`
@v0.10.0); it was ghcr.io/llm-d/llm-d-inference-scheduler before."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

REPO = "github.com/llm-d/llm-d-router"
RELEASE = "v0.10.0"
COMMIT = "71f4f0999f95b96c49a9d0c4afbd18dfdb943c26"
IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker"  # Makefile EPP_IMAGE_NAME @v0.10.0 (llm-d-router#1098)
API_VERSION = "llm-d.ai/v1alpha1"  # apix/config/v1alpha1; configloader.go's deprecatedSchemeGroupVersion below
DEPRECATED_API_VERSIONS = frozenset({"inference.networking.x-k8s.io/v1alpha1"})
KIND = "EndpointPickerConfig"
POOL_GROUP = "inference.networking.k8s.io"  # pkg/common/routing/common.go InferencePoolAPIGroup (the default)
PREFILL_HEADER = "x-prefiller-host-port"  # pkg/common/routing/common.go PrefillEndpointHeader

# apix/config/v1alpha1/endpointpickerconfig_types.go @v0.10.0: the json names of each struct
CONFIG_KEYS = frozenset(
    {
        "apiVersion",
        "kind",
        "featureGates",
        "plugins",
        "schedulingProfiles",
        "dataLayer",
        "flowControl",
        "requestHandler",
        "saturationDetector",
        "parser",
    }
)
PLUGIN_SPEC_KEYS = frozenset({"name", "type", "parameters"})
PROFILE_KEYS = frozenset({"name", "plugins"})
PROFILE_PLUGIN_KEYS = frozenset({"pluginRef", "weight"})


class Stability(enum.StrEnum):
    BETA = "beta"
    ALPHA = "alpha"  # needs --allow-experimental-plugins


class Role(enum.StrEnum):
    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"
    PROFILE_HANDLER = "profile-handler"
    DECIDER = "decider"
    PRODUCER = "producer"
    PRE_REQUEST = "pre-request"


PARAMETERS_IGNORED = None  # the factory takes `_ *json.Decoder`
Fields = dict[str, "Fields | None"]  # json field -> its nested struct's fields (None: a leaf)


@dataclass(frozen=True)
class Plugin:
    """One registered plugin type: where it is defined, what it is, and the json fields its parameter struct
    declares (nested structs as dicts; `alternatives`: another struct the factory also accepts, strictly)."""

    source: str  # path in llm-d-router @v0.10.0
    role: Role
    parameters: Fields | None
    stability: Stability = Stability.BETA
    deprecated: str | None = None  # "<since>: <replacement>"
    alternatives: tuple[Fields, ...] = ()
    refs: dict[str, Role] = field(default_factory=dict)  # `pluginRef` fields (dotted) -> what they must name
    ref_defaults: dict[str, str] = field(default_factory=dict)  # a ref's default when the field is unset


_PLUGINS = "pkg/epp/framework/plugins"
_DISAGG = f"{_PLUGINS}/scheduling/profilehandler/disagg"
_PICKER: Fields = {"maxNumOfEndpoints": None}  # scheduling/picker/common.go PickerParameters

# Registered in cmd/epp/runner/runner.go @v0.10.0 (fwkplugin.Register*); the ones a P/D layout uses, and the ones
# older kvpush configs used.
PLUGINS: dict[str, Plugin] = {
    "prefill-filter": Plugin(f"{_PLUGINS}/scheduling/filter/bylabel/roles.go", Role.FILTER, PARAMETERS_IGNORED),
    "decode-filter": Plugin(f"{_PLUGINS}/scheduling/filter/bylabel/roles.go", Role.FILTER, PARAMETERS_IGNORED),
    "prefix-cache-scorer": Plugin(
        f"{_PLUGINS}/scheduling/scorer/prefix/plugin.go",  # Config
        Role.SCORER,
        {"prefixMatchInfoProducerName": None, "matchLengthWeight": None, "matchLengthScaleTokens": None},
    ),
    "approx-prefix-cache-producer": Plugin(
        f"{_PLUGINS}/requestcontrol/dataproducer/approximateprefix/types.go",  # config
        Role.PRODUCER,
        {
            "autoTune": None,
            "blockSizeTokens": None,
            "blockSize": None,  # deprecated: characters
            "maxPrefixBlocksToMatch": None,  # deprecated
            "maxPrefixTokensToMatch": None,
            "lruCapacityPerServer": None,
        },
    ),
    "queue-scorer": Plugin(f"{_PLUGINS}/scheduling/scorer/queuedepth/queue.go", Role.SCORER, PARAMETERS_IGNORED),
    "kv-cache-utilization-scorer": Plugin(
        f"{_PLUGINS}/scheduling/scorer/kvcacheutilization/kvcache_utilization.go", Role.SCORER, PARAMETERS_IGNORED
    ),
    "max-score-picker": Plugin(f"{_PLUGINS}/scheduling/picker/maxscore/picker.go", Role.PICKER, _PICKER),
    "random-picker": Plugin(f"{_PLUGINS}/scheduling/picker/random/picker.go", Role.PICKER, _PICKER),
    "always-disagg-pd-decider": Plugin(f"{_DISAGG}/always_disagg_pd_decider.go", Role.DECIDER, PARAMETERS_IGNORED),
    "prefix-based-pd-decider": Plugin(
        f"{_DISAGG}/prefix_based_pd_decider.go",  # PrefixBasedPDDeciderConfig
        Role.DECIDER,
        {"nonCachedTokens": None, "promptTokens": None},
    ),
    "disagg-profile-handler": Plugin(
        f"{_DISAGG}/disagg_profile_handler.go",  # DisaggProfileHandlerParameters; also sets x-prefiller-host-port
        Role.PROFILE_HANDLER,
        {
            "stageOrder": None,
            "profiles": {"decode": None, "prefill": None, "encode": None},
            "deciders": {"prefill": None, "encode": None},
        },
        alternatives=(  # legacyDisaggProfileHandlerParameters (deprecated flat form)
            {
                "stageOrder": None,
                "decodeProfile": None,
                "prefillProfile": None,
                "encodeProfile": None,
                "prefillDeciderPluginName": None,
                "encodeDeciderPluginName": None,
                "deciderPluginName": None,
            },
        ),
        refs={
            "deciders.prefill": Role.DECIDER,
            "deciders.encode": Role.DECIDER,
            "prefillDeciderPluginName": Role.DECIDER,  # the flat form's
            "encodeDeciderPluginName": Role.DECIDER,
            "deciderPluginName": Role.DECIDER,
        },
    ),
    "pd-profile-handler": Plugin(
        f"{_DISAGG}/pd_profile_handler.go",  # PdProfileHandlerParameters
        Role.PROFILE_HANDLER,
        {
            "decodeProfile": None,
            "prefillProfile": None,
            "prefixPluginType": None,
            "prefixPluginName": None,
            "primaryPort": None,
            "deciderPluginName": None,
            "prefixMatchInfoProducerName": None,
        },
        deprecated="v0.7.0: disagg-profile-handler",
        refs={"deciderPluginName": Role.DECIDER},
        ref_defaults={"deciderPluginName": "prefix-based-pd-decider"},
    ),
    "prefill-header-handler": Plugin(
        f"{_DISAGG}/disagg_headers_handler.go",
        Role.PRE_REQUEST,
        {"prefillProfile": None, "encodeProfile": None},
        deprecated="v0.9.0: disagg-profile-handler",
    ),
    "disagg-headers-handler": Plugin(
        f"{_DISAGG}/disagg_headers_handler.go",
        Role.PRE_REQUEST,
        {"prefillProfile": None, "encodeProfile": None},
        deprecated="v0.9.0: disagg-profile-handler",
    ),
}


def unknown_fields(parameters: Any, fields: Fields, at: str = "") -> list[str]:
    """The keys of `parameters` (a decoded json object) that the struct `fields` does not declare, dotted."""
    if not isinstance(parameters, dict):
        return []
    found = []
    for key, value in parameters.items():
        if key not in fields:
            found.append(f"{at}{key}")
            continue
        nested = fields[key]
        if nested is not None:
            found += unknown_fields(value, nested, f"{at}{key}.")
    return found


def ref_value(parameters: Any, path: str) -> Any:
    """The value at a dotted path of a parameters object; None where absent."""
    value = parameters
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value
