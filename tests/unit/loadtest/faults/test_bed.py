"""The fault bed's stand-ins are named to the router as the engines they stand in for (no sockets)."""

from loadtest.faults import bed


def test_a_prefill_stand_in_gets_the_engine_specs_prefill_spec_and_a_decode_its_url() -> None:
    assert bed.standin_arg("prefill", "p0", 8123) == "http://127.0.0.1:8123,engine_id=p0,side_port=5600"
    assert bed.standin_arg("decode", "d0", 8124) == "http://127.0.0.1:8124"
