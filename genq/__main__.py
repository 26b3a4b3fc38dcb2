"""`python -m genq`: the `genq` command line; the one module of genq/ allowed above genq.commands."""

from genq.commands.cli import main

main()
