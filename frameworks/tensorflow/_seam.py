"""The collective internals the TensorFlow adapter uses, imported in this one place.

Everything else in `frameworks.tensorflow` imports only `collective`'s public names, and these.
"""
from __future__ import annotations

from collective.engines.device import DeviceBuffer, DeviceResult
from collective.ops import run_one, wait_now

__all__ = ["run_one", "wait_now", "DeviceBuffer", "DeviceResult", "CPU_DEVICE"]

CPU_DEVICE = -1  # the engines' device index for host memory
