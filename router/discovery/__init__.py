"""Worker discovery: sources that keep one role's pool membership current (static, DNS, Kubernetes)."""
