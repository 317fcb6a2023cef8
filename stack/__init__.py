"""Local serving stack: the tiny offline model, real vLLM CPU engines and the router as child processes."""
