"""Real PS and redis-server processes on free ports, for tests and benchmarks.

Not used by the runtime: the trainer, the PS and the client never import this package.
"""
