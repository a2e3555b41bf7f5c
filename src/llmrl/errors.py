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
    reward under --strict_rewards); the message says where the last good checkpoint is. every_rank: the same stop
    is raised on every rank of a multi-process run (a collective's failure), so only rank 0 prints it."""

    def __init__(self, message: str = "", every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class EngineDied(RunStopped):
    """The rollout engine's process went away mid-run (a vLLM server killed or crashed): the loop saves the
    last step learned and stops with one line."""
