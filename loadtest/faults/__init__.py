"""The fault matrix (issue 10): one command that injects each fault into a live P/D stack and checks that
nothing is lost.

    python -m loadtest.faults [--short] [--out bench/faults]

Rows (`rows.ROWS`) run on real vLLM CPU engines (two prefills, one decode, our push connector) behind a real
router, and on the hostile stand-in workers (loadtest/faults/hostile_workers.py) for the faults a real engine
cannot be made to show (answering 5xx, reading slowly). The vLLM bed comes in shapes (bed.BedShape, issue 42):
`vllm` plain; `vllm-preempt` a chunked, small-cache p1 (sustained.py's preemption row, residual.py's hung
prefill mid-push); `vllm-tp` a TP=2 p0 (ranks.py); `vllm-link` the engines behind a shaped link (link.py).
Scenarios: scenarios.py (the first matrix), sustained.py (rows under load, a killed router replica).

For each row it records the client's outcome, the time from the fault to that outcome, and afterwards the
router's in-flight gauges and every engine's running requests and KV usage (waiting until they settle). A row is
clean when nothing is stuck, no counter is left held and no KV block is left in use. Writes matrix.json and a
README table.
"""
