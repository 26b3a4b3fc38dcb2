"""genq: the shared contract every role imports (settings, Redis connection and keys, job and record
schemas, backends, sources, progress counts).

The floors, top to bottom: ``python -m genq`` (__main__.py) > genq.commands (the command line and
its tools) > the roles: genq.producer, genq.worker, genq.collector, genq.checker, genq.outputs and
genq.sim, each on its own (their folders sit at the top of the repository; genq/<role> links to
each) > the contract, the rest of this package, which imports no role and no command.
`lint-imports` enforces it (the contracts are in pyproject.toml).
"""

__version__ = "0.1.0"
