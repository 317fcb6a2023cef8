"""The benchmark room: the suites (`suites/`), their kit (processes, one measured point, probes, profiling) and
`kvpush bench` (`run.py`)."""
