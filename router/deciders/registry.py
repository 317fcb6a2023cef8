"""The deciders by name: the one place that imports every decider and registers it (llm-d's plugin layout). Pure.

The seam (router/decider.py) imports none of them. The `decider` setting names an entry; its factory checks the
decider's own options and raises ConfigError on bad ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.decider import Decider, NoDecider
from router.deciders.session_affinity import SessionAffinity
from router.errors import ConfigError

DeciderFactory = Callable[[Mapping[str, Any]], Decider]  # takes the decider's own settings block


def _no_decider(options: Mapping[str, Any]) -> Decider:
    if options:
        raise ConfigError(f"decider 'none' takes no options, got {sorted(options)}")
    return NoDecider()


def _session_affinity(options: Mapping[str, Any]) -> Decider:
    return SessionAffinity.from_options(options)


REGISTRY: dict[str, DeciderFactory] = {NoDecider.name: _no_decider, SessionAffinity.name: _session_affinity}


def register(name: str, factory: DeciderFactory) -> None:
    REGISTRY[name] = factory


def make_decider(name: str, options: Mapping[str, Any] | None = None) -> Decider:
    try:
        factory = REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown decider {name!r}; known deciders: {known}") from None
    return factory(options or {})
