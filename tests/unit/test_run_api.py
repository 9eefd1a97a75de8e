"""`horovod.run`'s arguments (launcher/api.py) against Horovod's: deprecated names, argument
errors that name the Python argument. Nothing is launched (the launch is patched out)."""
from __future__ import annotations

import inspect
import warnings

import pytest

from launcher import api


@pytest.fixture
def launched(monkeypatch):
    """The `LaunchSettings` (and elastic values) `run` would launch with; no process starts."""
    seen: dict = {}
    monkeypatch.setattr(api, "_run_tcp", lambda settings, blob: seen.setdefault("s", settings)
                        and [None] * settings.num_proc)
    monkeypatch.setattr(api, "_run_mpi", lambda settings, blob: seen.setdefault("s", settings)
                        and [None] * settings.num_proc)

    def elastic(settings, blob, min_np, max_np, *rest):
        seen.update(s=settings, min_np=min_np, max_np=max_np)
        return []
    monkeypatch.setattr(api, "_run_elastic", elastic)
    return seen


def test_signature_matches_horovods_order():
    """Horovod 0.28's parameter order (positional callers get the same binding)."""
    assert list(inspect.signature(api.run).parameters) == [
        "func", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "slots",
        "reset_limit", "cooldown_range", "hosts", "hostfile", "host_discovery_script",
        "start_timeout", "ssh_port", "ssh_identity_file", "disable_cache", "output_filename",
        "verbose", "use_gloo", "use_mpi", "mpi_args", "network_interface", "network_interfaces",
        "executable", "np", "min_np", "max_np"]


@pytest.mark.parametrize("old,new,value,extra", [
    ("np", "num_proc", 2, {}),
    ("min_np", "min_num_proc", 2, {"hosts": "a:2,b:2"}),
    ("max_np", "max_num_proc", 3, {"hosts": "a:2,b:2", "num_proc": 2}),
    ("network_interface", "network_interfaces", "lo", {}),
])
def test_deprecated_names_warn_naming_the_replacement(launched, old, new, value, extra):
    """They were taken silently; Horovod warns `<old> is deprecated, use <new> instead`."""
    with pytest.warns(DeprecationWarning, match=f"^{old} is deprecated, use {new} instead$") \
            as caught:
        api.run(print, use_gloo=True, **{old: value}, **extra)
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]
    s = launched["s"]
    if old == "np":
        assert s.num_proc == 2
    elif old == "min_np":
        assert launched["min_np"] == 2 and s.num_proc == 2
    elif old == "max_np":
        assert launched["max_np"] == 3
    else:
        assert s.network_interfaces == ("lo",)


def test_new_names_do_not_warn(launched):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.run(print, num_proc=2, use_gloo=True, network_interfaces=["lo"])
        api.run(print, num_proc=2, min_num_proc=1, max_num_proc=3, hosts="a:2,b:2")


def test_deprecated_name_wins_as_in_horovod(launched):
    with pytest.warns(DeprecationWarning):
        api.run(print, num_proc=1, np=3, use_gloo=True)
    assert launched["s"].num_proc == 3
