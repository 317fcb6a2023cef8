"""`kvpush serve --help` states the defaults the router really has (router/config.py `Settings`)."""

from __future__ import annotations

import dataclasses
import re

from router.cli import serve_parser
from router.config import Settings

_DEFAULT = re.compile(r"\(default (\d+(?:\.\d+)?)\)")


def test_every_numeric_default_in_the_help_is_the_settings_default() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(Settings) if isinstance(f.default, int | float)}
    checked = []
    for action in serve_parser()._actions:
        found = _DEFAULT.search(action.help or "")
        if found is None or action.dest not in defaults:
            continue
        assert float(found.group(1)) == float(defaults[action.dest]), (action.option_strings, action.help)
        checked.append(action.dest)
    assert {"health_interval", "retries", "max_in_flight", "admission_queue", "admission_wait"} <= set(checked)
