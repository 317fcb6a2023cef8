"""The legs to workers: the seam (base.py) and its transports beside it (aiohttp, httpx, this project's http1)."""
