"""loadtest.bench.block_runs: the run-length distribution of a point's WRITEs from the prefill's histograms."""

from loadtest import promtext
from loadtest.bench.block_runs import block_runs

ENGINE = 'engine="0",model_name="m"'


def _exposition(runs: dict[str, list[int]], descriptors: list[int]) -> dict[promtext.Sample, float]:
    """What prometheus_client writes for the histograms after observing ``runs`` and ``descriptors``."""
    lines = []
    for side, seen in runs.items():
        name = f"vllm:kvpush_run_blocks_{side}"
        for le in (1.0, 2.0, 4.0, 8.0, float("inf")):
            label = "+Inf" if le == float("inf") else f"{le}"
            lines.append(f'{name}_bucket{{{ENGINE},le="{label}"}} {sum(1 for n in seen if n <= le)}')
        lines += [f"{name}_count{{{ENGINE}}} {len(seen)}", f"{name}_sum{{{ENGINE}}} {sum(seen)}"]
    lines += [
        f"vllm:kvpush_num_descriptors_count{{{ENGINE}}} {len(descriptors)}",
        f"vllm:kvpush_num_descriptors_sum{{{ENGINE}}} {sum(descriptors)}",
    ]
    return promtext.parse("\n".join(lines))


def test_the_point_gets_the_runs_of_its_own_writes_only() -> None:
    before = _exposition({"prefill": [8], "decode": [8], "both": [8]}, [16])
    after = _exposition({"prefill": [8, 4, 4], "decode": [8, 1, 1, 2, 4], "both": [8, 1, 1, 2, 4]}, [16, 6, 2])
    out = block_runs(before, after)
    assert out["writes"] == 2 and out["descriptors_per_write"] == 4.0
    assert out["prefill"] == {
        "runs": 2,
        "blocks": 8,
        "mean": 4.0,
        "share": {"1": 0, "2": 0, "4": 1.0, "8": 0, "+Inf": 0},
    }
    assert out["both"]["runs"] == 4 and out["both"]["mean"] == 2.0
    assert out["both"]["share"] == {"1": 0.5, "2": 0.25, "4": 0.25, "8": 0.0, "+Inf": 0.0}


def test_a_point_without_writes_has_no_field() -> None:
    same = _exposition({"prefill": [3], "decode": [3], "both": [3]}, [2])
    assert block_runs(same, same) == {}
    assert block_runs({}, {}) == {}
