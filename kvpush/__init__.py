"""kvpush: the umbrella command over the router, the local stack and the load harness."""
