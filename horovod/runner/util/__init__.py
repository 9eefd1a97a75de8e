"""Horovod's `horovod.runner.util` package (helpers that scripts and test code import)."""
