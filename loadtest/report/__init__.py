"""The report room: bench/README.md (`readme.py`) from summary.json rows, one module per suite's section, the
shared table kit and the plots."""
