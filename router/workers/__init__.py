"""The workers: the pool, their health, scraped load and rank metrics, DP ranks, specs and pairing."""
