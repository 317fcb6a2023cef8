"""The benchmark suites: the one table of their names (the `suite` of a summary.json row) and modules.

Each module has FULL and SMOKE plans and `run(plan, run_dir, summary, progress, run_id)` (loadtest/README.md);
`kvpush bench` imports a suite's module only when it runs it.
"""

SUITES = {
    "seed-sim": "loadtest.bench.suites.seed",
    "cpu-vllm": "loadtest.bench.suites.cpu",
    "same-pair": "loadtest.bench.suites.samepair",
    "overhead": "loadtest.bench.suites.overhead",
    "multiturn": "loadtest.bench.suites.multiturn",
    "link": "loadtest.bench.suites.link",
    "link-wire": "loadtest.bench.suites.link_wire",
}
