"""The `genq` commands: the command line (cli.py) and the tools it gathers beside the roles' own
commands: `genq run` (run.py, with its private Redis in embedded.py and its children in
processes.py), `genq verify`, `genq status` and `genq monitor`, `genq dashboard`.

This floor sits on top of the roles: a command may import genq.producer, genq.worker,
genq.collector, genq.checker, genq.outputs, genq.sim and the contract (the rest of genq); nothing
below imports a command. Only
genq/__main__.py (`python -m genq`) sits above it. `lint-imports` enforces it.
"""
