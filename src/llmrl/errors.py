"""Errors the user can fix; the CLI prints their message as one line and exits 2."""


class UserError(Exception):
    """Base: str(e) is a complete one-line explanation."""


class ConfigError(UserError, ValueError):
    """An invalid configuration value or key."""


class ModelError(UserError):
    """A model name that cannot be resolved or loaded."""


class DataError(UserError):
    """A data source that is missing or has nothing usable in it."""
