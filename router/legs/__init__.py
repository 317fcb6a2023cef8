"""The legs to workers: the seam (base.py) and its transports beside it (this project's http1, httpx for tests)."""
