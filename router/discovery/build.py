"""Turns a discovery config into its running source, with the real resolver and HTTP transport by default."""

from __future__ import annotations

import os
from collections.abc import Mapping

import httpx

from router.discovery.base import ErrorHook, Source, StaticSource
from router.discovery.dns import DnspythonResolver, DnsSource, Resolver
from router.discovery.kubernetes import kubernetes_source
from router.discovery.settings import DnsConfig, SourceConfig, StaticConfig


def build_source(
    cfg: SourceConfig,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    resolver: Resolver | None = None,
    on_error: ErrorHook | None = None,
) -> Source:
    """The source for one role. `env` defaults to os.environ (Kubernetes in-cluster settings); `transport` and
    `resolver` are the I/O seams. Raises ConfigError when an in-cluster default is missing."""
    if isinstance(cfg, StaticConfig):
        return StaticSource(cfg.role, cfg.workers)
    if isinstance(cfg, DnsConfig):
        resolver = resolver or DnspythonResolver(cfg.nameserver, cfg.nameserver_port, cfg.timeout)
        return DnsSource(
            cfg.role,
            cfg.name,
            cfg.port,
            interval=cfg.interval,
            timeout=cfg.timeout,
            resolver=resolver,
            on_error=on_error,
        )
    return kubernetes_source(cfg, env=os.environ if env is None else env, transport=transport, on_error=on_error)
