"""Errors the user can fix; the CLI prints their message as one line and exits 2."""


class UserError(Exception):
    """Base: str(e) is a complete one-line explanation."""


class ConfigError(UserError, ValueError):
    """An invalid configuration value or key."""


class ModelError(UserError):
    """A model name that cannot be resolved or loaded."""


class DataError(UserError):
    """A data source that is missing or has nothing usable in it."""


class RunStopped(UserError):
    """The run stopped itself to lose nothing (repeated non-finite updates, a full disk, a raising
    reward under --strict_rewards); the message says where the last good checkpoint is."""


class EngineDied(RunStopped):
    """The rollout engine's process went away mid-run (a vLLM server killed or crashed): the loop saves the
    last step learned and stops with one line."""
