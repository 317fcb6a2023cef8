"""kvpush's push-mode KV connector for vLLM (see connector/README.md for the reading path)."""
