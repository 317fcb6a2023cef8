"""W3C trace headers in and out: valid values are read, bad ones are dropped as if absent, bounds hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.tracing import context as w3c

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
VALID = f"00-{TRACE}-{SPAN}-01"


def hdrs(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode("latin-1")) for k, v in pairs]


def test_a_valid_traceparent_is_the_parent() -> None:
    got = w3c.read(hdrs(("traceparent", VALID), ("content-type", "application/json")))
    assert got.parent == w3c.ParentContext(int(TRACE, 16), int(SPAN, 16), True)
    assert got.baggage is None


def test_no_trace_headers_is_a_new_root() -> None:
    assert w3c.read(hdrs(("content-type", "application/json"))) is w3c.NO_HEADERS


def test_the_sampled_flag_is_read_from_the_flags_bit() -> None:
    assert w3c.parse_traceparent(f"00-{TRACE}-{SPAN}-00".encode()).sampled is False  # type: ignore[union-attr]
    assert w3c.parse_traceparent(f"00-{TRACE}-{SPAN}-03".encode()).sampled is True  # type: ignore[union-attr]
    assert w3c.parse_traceparent(f"00-{TRACE}-{SPAN}-02".encode()).sampled is False  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        f"00-{TRACE.upper()}-{SPAN}-01",  # upper-case hex
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE}-{SPAN}-1",  # short flags
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00-{TRACE}x-{SPAN}-01",
        f"00_{TRACE}_{SPAN}_01",  # wrong separators
        f"0g-{TRACE}-{SPAN}-01",  # not hex
        f"00-{TRACE}-{SPAN}-zz",
        f"01-{TRACE}-{SPAN}-01x",  # a later version: more only after a dash
        f"01-{TRACE}-{SPAN}-01-" + "a" * 600,  # over the length bound
        f"00-{TRACE}-{SPAN}-0\u00e9",  # not ASCII
        f"00-{TRACE}\x00-{SPAN}-01",  # control character
    ],
)
def test_a_bad_traceparent_is_ignored(value: str) -> None:
    got = w3c.read(hdrs(("traceparent", value), ("tracestate", "a=b")))
    assert got.parent is None


def test_a_later_version_is_read_by_its_first_four_fields() -> None:
    parent = w3c.parse_traceparent(f"cc-{TRACE}-{SPAN}-01-what-the-future-holds".encode())
    assert parent is not None and parent.trace_id == int(TRACE, 16)


def test_whitespace_around_the_value_is_trimmed() -> None:
    assert w3c.parse_traceparent(f" \t{VALID} ".encode()) is not None


def test_two_traceparent_headers_are_invalid() -> None:
    assert w3c.read(hdrs(("traceparent", VALID), ("traceparent", VALID))).parent is None


def test_an_oversized_header_value_is_not_read() -> None:
    assert w3c.read(hdrs(("traceparent", VALID + " " * w3c.MAX_HEADER_BYTES))).parent is None


def test_tracestate_is_read_only_with_a_valid_parent() -> None:
    got = w3c.read(hdrs(("traceparent", VALID), ("tracestate", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7")))
    assert got.parent is not None
    assert got.parent.trace_state == (("congo", "t61rcWkgMzE"), ("rojo", "00f067aa0ba902b7"))
    assert w3c.read(hdrs(("traceparent", "bad"), ("tracestate", "congo=x"))).parent is None


def test_tracestate_headers_join_bad_members_drop_first_key_wins() -> None:
    got = w3c.parse_tracestate([b"a=1,BAD=2,b=,c=3", b"a=9, t@sys=4, x= 5", b"d=caf\xc3\xa9"])
    assert got == (("a", "1"), ("c", "3"), ("t@sys", "4"), ("x", " 5"))  # a value may start with a space


def test_tracestate_is_bounded_in_members_and_length() -> None:
    many = ",".join(f"k{i}=v" for i in range(40)).encode()
    assert len(w3c.parse_tracestate([many])) == w3c.MAX_TRACESTATE_MEMBERS
    long = ",".join(f"k{i}={'v' * 200}" for i in range(5)).encode()
    kept = w3c.parse_tracestate([long])
    assert len(w3c.tracestate(kept)) <= w3c.MAX_TRACESTATE_CHARS
    assert len(kept) == 2  # whole members only


def test_baggage_is_checked_normalised_and_bounded() -> None:
    got = w3c.read(hdrs(("baggage", "userId=alice, bad key=1,serverNode=DF%2028;p1;p2=x"), ("baggage", "k=v")))
    assert got.parent is None
    assert got.baggage == "userId=alice,serverNode=DF%2028;p1;p2=x,k=v"
    many = ",".join(f"k{i}=v" for i in range(100)).encode()
    assert w3c.parse_baggage([many]).count(",") + 1 == w3c.MAX_BAGGAGE_MEMBERS  # type: ignore[union-attr]
    big = ",".join(f"k{i}={'v' * 1000}" for i in range(20)).encode()
    assert len(w3c.parse_baggage([big]) or "") <= w3c.MAX_BAGGAGE_BYTES
    assert w3c.parse_baggage([b"no-equals", b'k="quoted"']) is None


def test_leg_headers_name_the_given_span() -> None:
    out = w3c.leg_headers(TRACE, 0x1234, True, [("a", "1")], "k=v")
    assert out == {"traceparent": f"00-{TRACE}-0000000000001234-01", "tracestate": "a=1", "baggage": "k=v"}
    assert w3c.leg_headers(f"{1:032x}", 2, False, (), None) == {"traceparent": w3c.traceparent(1, 2, False)}


@given(st.binary(max_size=200))
def test_any_bytes_never_raise(raw: bytes) -> None:
    w3c.read([(b"traceparent", raw), (b"tracestate", raw), (b"baggage", raw)])


@given(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.booleans())
def test_what_is_written_reads_back(trace_id: int, span_id: int, sampled: bool) -> None:
    value = w3c.traceparent(trace_id, span_id, sampled)
    assert w3c.parse_traceparent(value.encode()) == w3c.ParentContext(trace_id, span_id, sampled)
