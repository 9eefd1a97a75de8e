"""Static launches: tcp mode (workers spawned here, rendezvous server) and MPI mode (mpirun).

tcp mode, following Horovod's `gloo_run.launch_gloo`:

1. slot assignment; hosts that are not this machine are remote;
2. `ssh <host> true` on every remote host, within --start-timeout;
3. the rendezvous `KVServer` binds to 127.0.0.1 (all-local job) or to the address the job's
   network uses, with a fresh 32-byte secret;
4. one worker per slot: local ones directly, remote ones through ssh + `launcher.remote_exec`
   (environment and secret over the ssh channel's stdin);
5. `JobRunner` prefixes output, fails fast and stops everything on a signal.
"""
from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
from typing import Callable, Mapping, TextIO

from collective.config import environ_snapshot

from . import mpi_cleanup, network, ssh
from .env import SECRET_ENV, cpu_count, worker_env
from .hosts import get_host_assignments
from .mpirun import build_mpirun_command, detect_mpi
from .process import JobResult, JobRunner, WorkerSpec
from .remote_exec import payload
from .settings import LaunchSettings

__all__ = ["run_tcp", "mpi_command", "run_mpi", "check_remote_hosts", "describe_plan",
           "detected_mpi_text"]

_DETECTED: list = []  # the MPIImpl found by the last mpi_command (mpirun --version is slow)


def detected_mpi_text() -> str:
    """'Open MPI 5.0' for the MPI that the last `mpi_command` detected ('' if none)."""
    if not _DETECTED:
        return ""
    impl = _DETECTED[-1]
    names = {"openmpi": "Open MPI", "spectrum": "Spectrum MPI", "mpich": "MPICH",
             "intel": "Intel MPI"}
    version = ".".join(str(v) for v in impl.version[:2])
    return f"{names.get(impl.name, impl.name)} {version}".strip()

# Launcher-set variables a nested launch must not inherit from its parent's environment.
_TOPOLOGY_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
                  "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", SECRET_ENV,
                  "_HOROVOD_SECRET_KEY")


def _parent_env() -> dict[str, str]:
    env = environ_snapshot()
    for k in _TOPOLOGY_VARS:
        env.pop(k, None)
    return env


def describe_plan(settings: LaunchSettings, local: set[str],
                  rendezvous: tuple[str, int] | None = None) -> str:
    """Human-readable launch plan for --verbose (contains no secret)."""
    slots = get_host_assignments(settings.hosts, settings.num_proc)
    lines = [f"hvdrun: launch plan: mode {settings.mode}, {settings.num_proc} process(es) on "
             f"{len(settings.used_hosts)} host(s)"]
    for h in settings.used_hosts:
        ranks = [s.rank for s in slots if s.hostname == h.hostname]
        where = "local" if network.is_local_host(h.hostname, local) else "ssh"
        lines.append(f"  host {h.hostname}: {h.slots} slot(s) used, ranks {ranks[0]}-{ranks[-1]} "
                     f"({where})")
    for s in slots:
        lines.append(f"  rank {s.rank}: host={s.hostname} local_rank={s.local_rank} "
                     f"local_size={s.local_size} cross_rank={s.cross_rank} "
                     f"cross_size={s.cross_size}")
    if rendezvous is not None:
        lines.append(f"  rendezvous server: {rendezvous[0]}:{rendezvous[1]}")
    for k, v in sorted(settings.env_overrides.items()):
        lines.append(f"  env {k}={v}")
    lines.append(f"  command: {shlex.join(settings.command)}")
    return "\n".join(lines)


def check_remote_hosts(settings: LaunchSettings, local: set[str] | None = None) -> list[str]:
    """Runs `ssh <host> true` on the job's remote hosts, all within --start-timeout, as
    horovodrun does before it launches in either mode (mpirun itself would wait for an
    unreachable host for minutes, silently).

    Returns:
        The remote hosts (the ones that are not this machine).

    Raises:
        ssh.StartTimeoutError: a remote host did not answer within --start-timeout.
        ssh.SSHCheckError: ssh to a remote host failed.
    """
    local = network.local_addresses() if local is None else local
    remote = [h.hostname for h in settings.used_hosts
              if not network.is_local_host(h.hostname, local)]
    ssh.check_hosts(remote, settings.start_timeout, settings.ssh_port,
                    settings.ssh_identity_file)
    return remote


def run_tcp(settings: LaunchSettings, *,
            on_server_started: Callable[[object, tuple[str, int], bytes], None] | None = None,
            command_for_rank: Callable[[int], list[str]] | None = None,
            stdout: TextIO | None = None, stderr: TextIO | None = None) -> JobResult:
    """Runs a tcp-mode job to completion.

    Args:
        settings: the launch.
        on_server_started: called with (server, address, secret) before any worker starts
            (horovod.run stores the pickled function there).
        command_for_rank: per-rank command (default: `settings.command`).
        stdout, stderr: console streams for the prefixed worker output.

    Raises:
        ssh.StartTimeoutError: a remote host did not answer ssh within --start-timeout.
        ssh.SSHCheckError: ssh to a remote host failed.
        OSError: the rendezvous server cannot bind, or output files cannot be created.
        ValueError: a --network-interface does not exist here.
    """
    from collective.rendezvous import KVServer  # noqa: PLC0415 - only tcp mode needs it

    slots = get_host_assignments(settings.hosts, settings.num_proc)
    local = network.local_addresses()
    remote_hosts = check_remote_hosts(settings, local)

    address = network.choose_server_address(remote_hosts, settings.network_interfaces)
    overrides = dict(settings.env_overrides)
    nics = list(settings.network_interfaces)
    if not nics and remote_hosts:
        nic = network.interface_of_address(address)
        nics = [nic] if nic else []
    if nics:
        overrides.setdefault("HOROVOD_GLOO_IFACE", nics[0])
        overrides.setdefault("NCCL_SOCKET_IFNAME", ",".join(nics))

    secret = secrets.token_bytes(32)
    server = KVServer(host=address, port=0, secret=secret)
    rendezvous = server.start()
    try:
        if on_server_started is not None:
            on_server_started(server, rendezvous, secret)
        if settings.verbose:
            (stderr or sys.stderr).write(describe_plan(settings, local, rendezvous) + "\n")
        parent = _parent_env()
        cores = cpu_count()
        cwd = os.getcwd()
        workers = []
        for s in slots:
            is_remote = s.hostname in remote_hosts
            env = worker_env(parent, s, remote=is_remote, overrides=overrides,
                             rendezvous=rendezvous, secret_hex=secret.hex(),
                             oversubscribed=not is_remote and s.local_size > cores)
            cmd = command_for_rank(s.rank) if command_for_rank else list(settings.command)
            if is_remote:
                argv = ssh.ssh_worker_argv(s.hostname, cmd, cwd, settings.ssh_port,
                                           settings.ssh_identity_file)
                workers.append(WorkerSpec(s.rank, s.hostname, argv, dict(parent),
                                          stdin_payload=payload(env), remote=True))
            else:
                workers.append(WorkerSpec(s.rank, s.hostname, cmd, env))
        runner = JobRunner(workers, output_dir=settings.output_filename,
                           prefix_timestamp=settings.prefix_timestamp, stdout=stdout,
                           stderr=stderr)
        return runner.run()
    finally:
        server.stop()


def mpi_command(settings: LaunchSettings, extra_env: Mapping[str, str] | None = None,
                command: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The `mpirun` argv and the environment to run it with.

    Raises:
        mpirun.MPIUnavailableError: mpirun is missing or unrecognised.
        ValueError: an option the detected MPI cannot honour.
    """
    impl = detect_mpi()
    _DETECTED[:] = [impl]
    env = _parent_env()
    env.update(settings.env_overrides)
    if extra_env:
        env.update(extra_env)
    local = network.local_addresses()
    cores = cpu_count()
    oversubscribed = any(network.is_local_host(h.hostname, local) and h.slots > cores
                         for h in settings.used_hosts)
    if oversubscribed:
        # Open MPI's busy polling with more ranks than cores makes latency bimodal.
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if settings.tcp_only:
        env["NCCL_IB_DISABLE"] = "1"
    if settings.network_interfaces:  # as horovodrun's mpi_run, and this launcher's tcp mode
        env.setdefault("NCCL_SOCKET_IFNAME", ",".join(settings.network_interfaces))
    env.setdefault("PYTHONUNBUFFERED", "1")  # ranks' lines reach mpirun's tagger promptly
    argv = build_mpirun_command(
        impl, num_proc=settings.num_proc, hosts=settings.used_hosts,
        command=command if command is not None else list(settings.command), env=env,
        is_root=os.geteuid() == 0, oversubscribe=oversubscribed, ssh_port=settings.ssh_port,
        ssh_identity_file=settings.ssh_identity_file,
        network_interfaces=settings.network_interfaces,
        output_filename=settings.output_filename, binding_args=settings.binding_args,
        mpi_args=settings.mpi_args, tcp_only=settings.tcp_only,
        extra_exports=sorted(extra_env or ()))
    return argv, env


def run_mpi(settings: LaunchSettings, extra_env: Mapping[str, str] | None = None,
            command: list[str] | None = None) -> int:
    """Runs mpirun as a child (for horovod.run) and returns its exit code.

    Raises:
        mpirun.MPIUnavailableError, ValueError: see `mpi_command`.
        ssh.StartTimeoutError, ssh.SSHCheckError: see `check_remote_hosts`.
    """
    argv, env = mpi_command(settings, extra_env, command)
    check_remote_hosts(settings)
    if settings.verbose:
        sys.stderr.write("hvdrun: " + shlex.join(argv) + "\n")
    before = mpi_cleanup.candidates()
    mpi_cleanup.clean_stale()
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        mpi_cleanup.clean_after(before, proc.pid)
