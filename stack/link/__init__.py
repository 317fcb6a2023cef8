"""An emulated network between prefill and decode: engines in their own network namespaces behind a shaped link.

Reading order: `plan.py` (pure: presets, rates, addresses, the engines' environment) -> `holders.py` (namespaces
owned by holder processes) -> `fabric.py` (`Link`: the namespaces, the bridge, the host veth, live rate changes,
interface byte counters) -> `access.py` (root, user namespace, or a clear refusal); `bypass.py` (pure: the decider's
bypass threshold for a calibrated link). See stack/README.md.
"""
