"""Horovod's `horovod.common.exceptions`: elastic scripts catch these two.

They are the very classes ringvod raises (defined in `collective.errors`), so
`except horovod.common.exceptions.HorovodInternalError` catches a failed collective and
`except HostsUpdatedInterrupt` catches a membership change, as under Horovod.
"""
from collective.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
