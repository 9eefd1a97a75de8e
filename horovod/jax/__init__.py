"""Alias of `frameworks.jax` (normally resolved by the import hook in `horovod/__init__.py`,
which never runs this file; kept so that tools which read files find the alias too)."""
import sys

import frameworks.jax as _impl

sys.modules[__name__] = _impl
