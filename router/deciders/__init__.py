"""The P/D deciders: the registry (registry.py) and each decider with what only it uses.

The seam is router/decider.py; it imports nothing from here.
"""
