"""genq: the shared contract every role imports (settings, Redis connection and keys, job and record
schemas, backends, sources, progress counts).

The floors, top to bottom: ``python -m genq`` (__main__.py) > genq.commands (the command line and
its tools) > the roles: producer, worker, collector, and sim, each on its own > the contract, the
rest of this package, which imports no role and no command. `lint-imports` enforces it (the
contracts are in pyproject.toml).
"""

__version__ = "0.1.0"
