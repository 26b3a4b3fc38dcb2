"""genq's version, one home for it (the package, provenance and `genq --version` read it)."""

__version__ = "0.1.0"
