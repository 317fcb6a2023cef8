"""Engine simulator: a fake vLLM prefill/decode instance with a step-level cost model and KV handoff."""
