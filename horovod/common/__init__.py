"""Horovod's `horovod.common` package: the names user code imports from it."""
