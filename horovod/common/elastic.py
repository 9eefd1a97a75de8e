"""Horovod's `horovod.common.elastic`: the framework-neutral elastic state and retry loop, for
code that builds its own state or wrapper on them (`class MyState(ObjectState)`,
`run_fn(func, reset)`). They are ringvod's own (`collective.elastic`), so `hvd.elastic.State`
and `ObjectState` of every framework are these very classes.
"""
from collective.elastic import ObjectState, State, run_fn

__all__ = ["State", "ObjectState", "run_fn"]
