"""Alias of Horovod's `horovod.runner`: `run` is `launcher.api.run`."""
from launcher.api import run

__all__ = ["run"]
