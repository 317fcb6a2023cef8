"""The deciders by name: the one place that imports every decider and registers it (llm-d's plugin layout). Pure.

The seam (router/decider.py) imports none of them. The `decider` setting names an entry; its factory checks the
decider's own options and raises ConfigError on bad ones. A factory also gets the KV-event view when the router
follows its engines' KV events (router/kv_events), None otherwise; a decider that has no use for it ignores it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.decider import Decider, NoDecider
from router.deciders.session_affinity import SessionAffinity
from router.errors import ConfigError
from router.kv_events.view import KvEventView

DeciderFactory = Callable[[Mapping[str, Any], KvEventView | None], Decider]  # its settings block, the KV view


def _no_decider(options: Mapping[str, Any], view: KvEventView | None) -> Decider:
    if options:
        raise ConfigError(f"decider 'none' takes no options, got {sorted(options)}")
    return NoDecider()


def _session_affinity(options: Mapping[str, Any], view: KvEventView | None) -> Decider:
    return SessionAffinity.from_options(options, view)


REGISTRY: dict[str, DeciderFactory] = {NoDecider.name: _no_decider, SessionAffinity.name: _session_affinity}


def register(name: str, factory: DeciderFactory) -> None:
    REGISTRY[name] = factory


def make_decider(name: str, options: Mapping[str, Any] | None = None, view: KvEventView | None = None) -> Decider:
    try:
        factory = REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown decider {name!r}; known deciders: {known}") from None
    return factory(options or {}, view)
