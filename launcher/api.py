"""`horovod.run`: run a Python function on N processes and return each rank's result.

The function travels through the job's authenticated key-value server: the launcher stores the
(cloud)pickled `(func, args, kwargs)`, each worker (`python -m launcher.run_task <addr>
<port>`) fetches and runs it and stores its pickled result, and the launcher returns the
results ordered by rank. Both modes work: tcp (workers spawned here or over ssh) and MPI
(through mpirun; the secret reaches the ranks by `-x NAME`, never as a value on the command
line).
"""
from __future__ import annotations

import pickle
import secrets
import sys
import warnings
from typing import Any, Callable, Sequence

from .hosts import HostInfo, hosts_arg, parse_hostfile, parse_hosts, total_slots
from .run_task import FUNC_KEY, FUNC_SCOPE, RESULT_SCOPE, dumps
from .settings import (MODE_MPI, MODE_TCP, LaunchSettings, default_mode,
                       start_timeout_or_env)

__all__ = ["run"]


def _hosts(num_proc: int, hosts: str | None, hostfile: str | None) -> list[HostInfo]:
    if hosts and hostfile:
        raise ValueError("Argument hosts and hostfile only allow one provided.")  # Horovod's text
    if hosts:
        found = parse_hosts(hosts, source="hosts")
    elif hostfile:
        found = parse_hostfile(hostfile)
    else:
        return [HostInfo("localhost", num_proc)]
    available = total_slots(found)
    if num_proc > available:
        raise ValueError(
            f"Requested more processes (num_proc={num_proc}) than there are available slots "
            f"({available}); hosts: {hosts_arg(found)}. Lower num_proc or add slots.")
    return found


def _count(name: str, value: Any, least: int) -> None:
    """Refuses a count argument that is not an int, or below `least`, naming the argument."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"horovod.run: {name} must be an int (got {value!r})")
    if value < least:
        raise ValueError(f"horovod.run: {name} must be at least {least} (got {value})")


def _deprecated(old: str, new: str) -> None:
    # Horovod's text; stacklevel 3 points at the caller of horovod.run.
    warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=3)


def _mode(use_gloo: bool | None, use_mpi: bool | None) -> str:
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")  # Horovod's
    if use_mpi:
        return MODE_MPI
    if use_gloo:
        return MODE_TCP
    return default_mode()


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, min_num_proc: int | None = None,
        max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
        hosts: str | None = None, hostfile: str | None = None,
        host_discovery_script: str | None = None, start_timeout: float | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None,
        verbose: bool | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | Sequence[str] | None = None,
        network_interfaces: Sequence[str] | None = None, executable: str | None = None,
        np: int | None = None, min_np: int | None = None, max_np: int | None = None,
        ) -> list[Any]:
    """Runs `func(*args, **kwargs)` on `num_proc` processes (Horovod's `horovod.run`).

    Each process may call `hvd.init()` and collectives; the function and its arguments must
    be picklable (cloudpickle is used when installed, so lambdas and closures work).

    Elastic form: with `min_num_proc` or `host_discovery_script` the job runs under the
    elastic driver (as `hvdrun --min-np ...`); `num_proc` is the size to start with,
    `max_num_proc`, `slots`, `reset_limit` and `cooldown_range` are the `--max-np`,
    `--slots-per-host`, `--reset-limit` and `--blacklist-cooldown-range` values, and the
    results are those of the last round's ranks. `func` then typically wraps its training in
    `hvd.elastic.run`. Without either, those four have no effect (a RuntimeWarning), as in
    Horovod. `disable_cache` has no effect either (ringvod caches no ssh/NIC checks): a true
    value gives a RuntimeWarning.

    `num_proc` defaults to 1 (to `min_num_proc` in an elastic run). `np`, `min_np`, `max_np`
    and `network_interface` are Horovod's deprecated spellings of `num_proc`, `min_num_proc`,
    `max_num_proc` and `network_interfaces`: they still work, with a `DeprecationWarning`
    naming the replacement (`np`, `min_np` and `max_np` win over the new names, as in Horovod;
    `network_interface`'s names are used together with `network_interfaces`').

    Example:
        >>> import horovod
        >>> def f():
        ...     import collective as hvd
        ...     hvd.init()
        ...     return hvd.rank()
        >>> horovod.run(f, num_proc=2, use_gloo=True)
        [0, 1]

    Returns:
        The function's return value on each rank, ordered by rank.

    Raises:
        ValueError: invalid arguments, named as the Python argument (num_proc below 1, too
            few slots, both hosts and hostfile, ...).
        TypeError: a count (num_proc, slots, ...) that is not an int.
        RuntimeError: a rank failed (the message names the first one), or ssh/MPI trouble.
        TimeoutError: remote hosts did not answer within `start_timeout`.
    """
    if disable_cache:
        warnings.warn("horovod.run(disable_cache=...) has no effect: ringvod caches no ssh/NIC "
                      "checks", RuntimeWarning, stacklevel=2)
    # Horovod's order and texts: each deprecated name warns and overrides the new one.
    if network_interface:
        _deprecated("network_interface", "network_interfaces")
    if np is not None:
        _deprecated("np", "num_proc")
        num_proc = np
    if min_np is not None:
        _deprecated("min_np", "min_num_proc")
        min_num_proc = min_np
    if max_np is not None:
        _deprecated("max_np", "max_num_proc")
        max_num_proc = max_np
    for name, value, least in (("num_proc", num_proc, 1), ("min_num_proc", min_num_proc, 1),
                               ("max_num_proc", max_num_proc, 1), ("slots", slots, 1),
                               ("reset_limit", reset_limit, 0), ("ssh_port", ssh_port, 0)):
        _count(name, value, least)
    # Elastic as Horovod decides it: max_num_proc alone leaves a static run (warned below).
    elastic = min_num_proc is not None or host_discovery_script is not None
    if num_proc is None:
        num_proc = min_num_proc if elastic and min_num_proc is not None else 1
    if elastic:
        low = min_num_proc if min_num_proc is not None else num_proc
        if low > num_proc or (max_num_proc is not None and max_num_proc < num_proc):
            raise ValueError(f"horovod.run: need min_num_proc ({low}) <= num_proc ({num_proc}) "
                             f"<= max_num_proc ("
                             f"{max_num_proc if max_num_proc is not None else 'unlimited'})")
        if cooldown_range is not None:
            if (not isinstance(cooldown_range, (tuple, list)) or len(cooldown_range) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool)
                               for v in cooldown_range)):
                raise ValueError(f"horovod.run: cooldown_range must be two ints (min, max) in "
                                 f"seconds, got {cooldown_range!r}")
            lo, hi = cooldown_range
            if not 1 <= lo <= hi <= 3600:
                raise ValueError(f"horovod.run: cooldown_range=({lo}, {hi}): need 1 <= min <= "
                                 "max <= 3600 (seconds)")
    if not elastic and any(v is not None for v in (max_num_proc, slots, reset_limit,
                                                   cooldown_range)):
        warnings.warn("horovod.run(max_num_proc=/slots=/reset_limit=/cooldown_range=) has no "
                      "effect unless the run is elastic (min_num_proc or "
                      "host_discovery_script)", RuntimeWarning, stacklevel=2)
    from .network import split_interfaces  # noqa: PLC0415

    nics = split_interfaces(
        ([network_interface] if isinstance(network_interface, str)
         else list(network_interface or ())) + list(network_interfaces or ()))
    py = executable or sys.executable
    if elastic and use_mpi:
        raise ValueError("elastic horovod.run (min_num_proc/host_discovery_script) needs the "
                         "tcp mode; drop use_mpi")
    settings = LaunchSettings(
        num_proc=num_proc, hosts=tuple(_hosts(num_proc, hosts, hostfile)),
        mode=MODE_TCP if elastic else _mode(use_gloo, use_mpi),
        command=(py, "-m", "launcher.run_task"),
        start_timeout=start_timeout_or_env(start_timeout),
        ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
        network_interfaces=tuple(nics), output_filename=output_filename,
        verbose=bool(verbose), mpi_args=mpi_args)
    if mpi_args and settings.mode == MODE_TCP:
        warnings.warn("horovod.run(mpi_args=...) has no effect: this run is in tcp mode ("
                      + ("elastic runs always are)" if elastic else
                         ("use_gloo=True" if use_gloo else "no mpirun/mpi4py found")
                         + "); pass use_mpi=True to run through mpirun"),
                      RuntimeWarning, stacklevel=2)
    blob = dumps((func, tuple(args), dict(kwargs or {})))
    if elastic:
        return _run_elastic(settings, blob, min_num_proc, max_num_proc, slots, reset_limit,
                            cooldown_range, host_discovery_script, bool(hosts or hostfile))
    if settings.mode == MODE_TCP:
        return _run_tcp(settings, blob)
    return _run_mpi(settings, blob)


def _collect(server: Any, num_proc: int) -> list[Any]:
    results = []
    for rank in range(num_proc):
        raw = server.get(RESULT_SCOPE, str(rank))
        if raw is None:
            raise RuntimeError(f"horovod.run: rank {rank} exited 0 but stored no result; did "
                               f"the function call os._exit or sys.exit?")
        results.append(pickle.loads(raw))
    return results


def _run_tcp(settings: LaunchSettings, blob: bytes) -> list[Any]:
    from .launch import run_tcp  # noqa: PLC0415
    from .process import failure_summary  # noqa: PLC0415

    state: dict[str, Any] = {}

    def started(server: Any, address: tuple[str, int], _secret: bytes) -> None:
        server.put(FUNC_SCOPE, FUNC_KEY, blob)
        state["server"], state["address"] = server, address

    def command(_rank: int) -> list[str]:
        host, port = state["address"]
        return list(settings.command) + [host, str(port)]

    result = run_tcp(settings, on_server_started=started, command_for_rank=command)
    if result.interrupted_by is not None:
        raise KeyboardInterrupt(f"horovod.run interrupted by {result.interrupted_by}")
    if result.failure is not None:
        raise RuntimeError(failure_summary(result.failure))
    # The server is stopped, but its store is still readable in this process.
    return _collect(state["server"], settings.num_proc)


def _run_mpi(settings: LaunchSettings, blob: bytes) -> list[Any]:
    from collective.rendezvous import KVServer  # noqa: PLC0415

    from . import network  # noqa: PLC0415
    from .env import SECRET_ENV  # noqa: PLC0415
    from .launch import run_mpi  # noqa: PLC0415

    local = network.local_addresses()
    remote = [h.hostname for h in settings.used_hosts
              if not network.is_local_host(h.hostname, local)]
    secret = secrets.token_bytes(32)
    server = KVServer(network.choose_server_address(remote, settings.network_interfaces), 0,
                      secret)
    host, port = server.start()
    try:
        server.put(FUNC_SCOPE, FUNC_KEY, blob)
        code = run_mpi(settings, extra_env={SECRET_ENV: secret.hex()},
                       command=list(settings.command) + [host, str(port)])
        if code != 0:
            # Horovod's text (mpi_run), then where to look.
            raise RuntimeError(f"mpirun failed with exit code {code} (horovod.run: the first "
                               f"failing rank's traceback is in the output above)")
        return _collect(server, settings.num_proc)
    finally:
        server.stop()


def _run_elastic(settings: LaunchSettings, blob: bytes, min_np: int | None, max_np: int | None,
                 slots: int | None, reset_limit: int | None,
                 cooldown_range: tuple[int, int] | None, script: str | None,
                 fixed_hosts: bool) -> list[Any]:
    from collective.config import read_env  # noqa: PLC0415

    from .elastic.launch import ElasticSettings, run_elastic  # noqa: PLC0415

    if not script and not fixed_hosts:
        raise ValueError("elastic horovod.run needs hosts/hostfile (two hosts or more) or "
                         "host_discovery_script")
    elastic = ElasticSettings(
        min_np=min_np if min_np is not None else settings.num_proc, max_np=max_np,
        discovery_script=script, slots_per_host=slots,
        elastic_timeout=read_env().elastic_timeout, reset_limit=reset_limit,
        cooldown_range=(float(cooldown_range[0]), float(cooldown_range[1]))
        if cooldown_range else None)
    state: dict[str, Any] = {}

    def started(server: Any, address: tuple[str, int], _secret: bytes) -> None:
        server.put(FUNC_SCOPE, FUNC_KEY, blob)
        state["server"], state["address"] = server, address

    # Workers find the server through HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT (run_task, no args).
    result = run_elastic(settings, elastic, on_server_started=started)
    if result.exit_code != 0:
        raise RuntimeError(f"horovod.run: elastic job failed: {result.error}\n"
                           f"{result.summary}")
    return _collect(state["server"], result.final_size)
