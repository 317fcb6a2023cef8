"""Value checks for settings: one rule per kind of value, each raising ConfigError that names where. Pure.

Every setting of the router (flags, environment, the YAML file, the discovery block, the admin API) is checked
here, so the same kind of value follows the same rule everywhere:

- booleans are never numbers (`true` is not 1 second or 1 retry), and numbers are never booleans;
- numbers must be finite; seconds must be above 0, except where 0 switches a feature off (`zero_off`);
- integers may be given as strings (environment variables, flags) but not as fractions;
- worker URLs are http or https base URLs with a host and no path, query, fragment or credentials
  (a password in a URL would end up in logs, metrics and /ready).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from router.errors import ConfigError

SCHEMES = ("http", "https")


def url(value: Any, where: str, *, schemes: tuple[str, ...] = SCHEMES) -> str:
    """A base URL (`scheme://host[:port]`), without its trailing slash."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: url is missing")
    text = value.strip()
    try:
        parts = urlsplit(text)
        port_number = parts.port  # raises ValueError for a port that is not a number or out of range
    except ValueError as exc:
        raise ConfigError(f"{where}: {shown_url(text)} is not a valid URL ({exc})") from None
    if port_number == 0:
        raise ConfigError(f"{where}: {shown_url(text)} has port 0")
    wanted = " or ".join(schemes)
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"{where}: {shown_url(text)} is not a base URL ({wanted}://host:port)")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{where}: a worker URL must not carry credentials (user:password@); got {shown_url(text)}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{where}: {text!r} must be a base URL without a path (the router adds /v1/...)")
    return text.rstrip("/")


def integer(value: Any, where: str, *, low: int, high: int | None = None) -> int:
    """An integer in [low, high]; a string of digits is accepted, a boolean or a fraction is not."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if number < low or (high is not None and number > high):
        raise ConfigError(f"{where}: {number} is out of range [{low}, {'inf' if high is None else high}]")
    return number


def number(value: Any, where: str, *, low: float = 0.0, high: float | None = None) -> float:
    """A finite number in [low, high]; a string is accepted, a boolean is not."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if not math.isfinite(result) or result < low or (high is not None and result > high):
        raise ConfigError(f"{where}: must be a finite number in [{low:g}, {'inf' if high is None else high}]")
    return result


def positive(value: Any, where: str) -> float:
    """A finite number above 0; a string is accepted, a boolean is not."""
    result = number(value, where)
    if result == 0:
        raise ConfigError(f"{where}: must be a positive, finite number, got {value!r}")
    return result


def seconds(value: Any, where: str, *, zero_off: bool = False) -> float:
    """A positive, finite number of seconds; 0 too when `zero_off` (0 switches the feature off)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number of seconds, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number of seconds, got {value!r}") from None
    if zero_off and result == 0:
        return 0.0
    if not (result > 0 and math.isfinite(result)):
        floor = "0 (off) or" if zero_off else "a"
        raise ConfigError(f"{where}: must be {floor} positive, finite number of seconds, got {value!r}")
    return result


def port(value: Any, where: str, *, zero_ok: bool = False) -> int:
    """A TCP port, 1..65535 (0 too when `zero_ok`: pick any free port)."""
    if value is None:
        raise ConfigError(f"{where}: the port is missing")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a port number, got {value!r}")
    try:
        result = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a port number, got {value!r}") from None
    if not (0 if zero_ok else 1) <= result <= 65535:
        raise ConfigError(f"{where}: {result} is out of range [{0 if zero_ok else 1}, 65535]")
    return result


def text(value: Any, where: str, *, secret: bool = False) -> str | None:
    """A non-empty string, stripped; None stays None. A secret's value is never shown in the message."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        shown = type(value).__name__ if secret else repr(value)
        raise ConfigError(f"{where}: expected a non-empty string, got {shown}")
    return value.strip()


def boolean(value: Any, where: str) -> bool:
    """true or false (also the strings "true"/"false", as environment variables give them)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def shown_url(text: str) -> str:
    """A URL as it may appear in a message (quoted): any credentials replaced by ***."""
    scheme, sep, rest = text.partition("://")
    authority = rest.split("/", 1)[0]
    if not sep or "@" not in authority:
        return repr(text)
    return repr(f"{scheme}://***@{authority.rpartition('@')[2]}{rest[len(authority) :]}")
