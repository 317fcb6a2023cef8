"""kvpush router: an OpenAI-compatible front door for prefill/decode disaggregated vLLM."""

__version__ = "0.1.0"
