"""Horovod's `horovod.common.process_sets`: `ProcessSet`, `global_process_set`,
`add_process_set`, `remove_process_set`, for code that imports them from here rather than from
`hvd`. They are ringvod's own (`collective`), so `hvd.ProcessSet` of every framework is this
very class and `global_process_set` this very object.
"""
from collective.basics import add_process_set, remove_process_set
from collective.process_sets import ProcessSet, global_process_set

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
