"""The version of piper-semantics: the one place it is written (its pyproject.toml reads it)."""

__version__ = "0.1.0"
