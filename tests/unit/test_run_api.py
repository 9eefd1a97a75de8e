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
    ("max_np", "max_num_proc", 3, {"hosts": "a:2,b:2", "num_proc": 2, "min_num_proc": 2}),
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


def test_disable_cache_warns_that_it_has_no_effect(launched):
    """It was dropped without a word; ringvod caches no ssh/NIC checks to disable."""
    with pytest.warns(RuntimeWarning, match=r"^horovod.run\(disable_cache=...\) has no effect: "
                                            "ringvod caches no ssh/NIC checks$") as caught:
        api.run(print, num_proc=1, use_gloo=True, disable_cache=True)
    assert [w.filename for w in caught] == [__file__]
    assert launched["s"].num_proc == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.run(print, num_proc=1, use_gloo=True, disable_cache=False)


def test_deprecated_name_wins_as_in_horovod(launched):
    with pytest.warns(DeprecationWarning):
        api.run(print, num_proc=1, np=3, use_gloo=True)
    assert launched["s"].num_proc == 3


@pytest.mark.parametrize("kwargs,message", [
    ({"num_proc": 0}, "horovod.run: num_proc must be at least 1 (got 0)"),
    ({"num_proc": -2}, "horovod.run: num_proc must be at least 1 (got -2)"),
    ({"np": 0}, "horovod.run: num_proc must be at least 1 (got 0)"),
    ({"num_proc": 3, "hosts": "a:1,b:1"},
     "Requested more processes (num_proc=3) than there are available slots (2); hosts: "
     "a:1,b:1. Lower num_proc or add slots."),
    ({"hosts": "a:0"}, "host 'a' in hosts has 0 slots"),
    ({"num_proc": 2, "min_num_proc": 0, "hosts": "a:1,b:1"},
     "horovod.run: min_num_proc must be at least 1 (got 0)"),
    ({"num_proc": 2, "min_num_proc": 3, "hosts": "a:2,b:2"},
     "horovod.run: need min_num_proc (3) <= num_proc (2) <= max_num_proc (unlimited)"),
    ({"num_proc": 2, "min_num_proc": 2, "max_num_proc": 1, "hosts": "a:1,b:1"},
     "horovod.run: need min_num_proc (2) <= num_proc (2) <= max_num_proc (1)"),
    ({"num_proc": 2, "host_discovery_script": "./d.sh", "slots": 0},
     "horovod.run: slots must be at least 1 (got 0)"),
    ({"num_proc": 2, "host_discovery_script": "./d.sh", "reset_limit": -1},
     "horovod.run: reset_limit must be at least 0 (got -1)"),
    ({"num_proc": 2, "host_discovery_script": "./d.sh", "cooldown_range": (9, 2)},
     "horovod.run: cooldown_range=(9, 2): need 1 <= min <= max <= 3600 (seconds)"),
    ({"num_proc": 2, "host_discovery_script": "./d.sh", "cooldown_range": (1,)},
     "horovod.run: cooldown_range must be two ints (min, max) in seconds, got (1,)"),
    ({"num_proc": 1, "ssh_port": -1}, "horovod.run: ssh_port must be at least 0 (got -1)"),
])
def test_argument_errors_name_the_python_argument(launched, kwargs, message):
    """They named hvdrun's flags (`-np must be at least 1`, `Lower -np`, `in -H`), or were not
    checked at all before the launch (min/max sizes, slots=0, cooldown_range, ssh_port)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError) as e:
            api.run(print, use_gloo=True, **kwargs)
    assert message in str(e.value)
    assert "-np" not in str(e.value) and "-H" not in str(e.value)
    assert "s" not in launched


@pytest.mark.parametrize("value", [2.0, "2", True])
def test_num_proc_must_be_an_int(launched, value):
    with pytest.raises(TypeError, match=r"horovod.run: num_proc must be an int"):
        api.run(print, num_proc=value, use_gloo=True)
