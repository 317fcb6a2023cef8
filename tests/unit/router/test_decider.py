"""router/decider.py, the seam: a route of the router's mode, and the label a route gives the request."""

from __future__ import annotations

from router.decider import Route
from router.domain import Mode


def test_a_route_of_the_mode_and_its_label() -> None:
    assert (Route.of(Mode.PUSH), Route.of(Mode.PULL)) == (Route.PUSH, Route.PULL)
    # the request's mode label is API (metrics, log lines): decode-only for the fallback, else the route's value
    assert [r.label for r in Route] == ["push", "pull", "bypass", "decode-only"]
