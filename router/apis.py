"""What differs between the APIs the hot path serves, in one table: the error shapes, how usage is stated and made
true (router/usage.py's rule), and which first stream events are no sign of life. Pure. The record, the trace and
the decider take every API's usage as OpenAI's (`usage_of`: prompt_tokens, completion_tokens,
prompt_tokens_details.cached_tokens).

OpenAI's completions and chat are the reference (router/sse.py, router/usage.py); Anthropic's Messages is in
router/messages.py, OpenAI's Responses in router/responses.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router import messages, responses, usage
from router.domain import Endpoint
from router.errors import RouterError
from router.sse import error_event


@dataclass(frozen=True)
class Api:
    """One API's shapes."""

    error_body: Callable[[RouterError], bytes]  # a refusal or failure before the 200
    error_event: Callable[[RouterError, bytes], bytes]  # in-band, after the 200 (and the last chunk relayed)
    with_cached: Callable[[bytes, int | None], bytes]  # whole answers or events, cached counts made `cached`
    usage_of: Callable[[Any], dict[str, Any] | None]  # an answer's or event's usage, as OpenAI's (the record's)
    cached_marker: bytes  # bytes every answer or event stating a cached count contains
    streams_usage: bool  # every stream carries usage (else only when the client asked: usage.wants_usage)
    held: Callable[[bytes], bool] | None = None  # first events that are not yet a sign of life
    # decode given P's count (pull) states it only in some events (Messages: not in `message_start`)
    restates_relayed: bool = False

    def wants_usage(self, body: Mapping[str, Any]) -> bool:
        return self.streams_usage or usage.wants_usage(body)


def _openai_error_event(error: RouterError, last: bytes = b"") -> bytes:
    return error_event(error)


OPENAI = Api(
    error_body=lambda error: error.to_json(),
    error_event=_openai_error_event,
    with_cached=usage.with_cached,
    usage_of=usage.usage_of,
    cached_marker=b'"cached_tokens"',
    streams_usage=False,
)
MESSAGES = Api(
    error_body=messages.error_body,
    error_event=messages.error_event,
    with_cached=messages.with_cached,
    usage_of=messages.openai_usage,
    cached_marker=b'"usage"',
    streams_usage=True,
    restates_relayed=True,
)
RESPONSES = Api(
    error_body=lambda error: error.to_json(),
    error_event=responses.error_event,
    with_cached=responses.with_cached,
    usage_of=responses.openai_usage,
    cached_marker=b"cached_tokens",
    streams_usage=True,
    held=responses.held,
)
_APIS = {
    Endpoint.COMPLETIONS: OPENAI,
    Endpoint.CHAT: OPENAI,
    Endpoint.MESSAGES: MESSAGES,
    Endpoint.RESPONSES: RESPONSES,
}


def api_of(endpoint: Endpoint) -> Api:
    return _APIS[endpoint]
