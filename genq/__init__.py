"""genq: the shared contract every role imports (settings, Redis keys, job and record schemas)."""

__version__ = "0.1.0"
