"""`hvdrun` elastic flags: validation into settings, and the launch."""
from __future__ import annotations

import argparse
import sys

from ..hosts import HostInfo, parse_hostfile, parse_hosts
from ..settings import MODE_TCP, LaunchSettings
from .launch import ElasticSettings

__all__ = ["elastic_settings_from_args", "launch_elastic"]


def elastic_settings_from_args(args: argparse.Namespace
                               ) -> tuple[LaunchSettings, ElasticSettings]:
    """Validates an elastic command line (`--min-np`, `--max-np`, `--host-discovery-script`).

    Raises:
        ValueError: inconsistent sizes, `--slots-per-host` below 1, MPI mode, or a fixed host
            list of one host.
        OSError: the hostfile cannot be read.
    """
    from collective.config import read_env  # noqa: PLC0415

    from ..cli import check_slots_per_host, settings_from_args  # noqa: PLC0415

    check_slots_per_host(args)
    if args.use_mpi:
        raise ValueError("elastic training (--min-np/--max-np/--host-discovery-script) needs "
                         "the tcp mode (Horovod's Gloo): drop --mpi")
    num_proc = args.num_proc if args.num_proc is not None else args.min_num_proc
    if num_proc is None:
        raise ValueError("give the number of processes to start with: -np N (or --min-np N)")
    min_np = args.min_num_proc if args.min_num_proc is not None else num_proc
    max_np = args.max_num_proc
    if not 1 <= min_np <= num_proc or (max_np is not None and max_np < num_proc):
        raise ValueError(f"need 1 <= --min-np ({min_np}) <= -np ({num_proc}) <= --max-np "
                         f"({max_np if max_np is not None else 'unlimited'})")
    if args.host_discovery_script:
        # Hosts come from the script; this placeholder only satisfies the static checks (the
        # command is not looked for here: the hosts may have it).
        hosts: list[HostInfo] = [HostInfo("localhost", num_proc)]
    else:
        hosts = (parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile)
                 if args.hostfile else [HostInfo("localhost", num_proc)])
        if len(hosts) < 2:
            raise ValueError("Cannot run in fault tolerance mode with fewer than 2 hosts. "
                             "Elastic jobs need -H with two hosts or more (localhost, "
                             "127.0.0.1 and this machine's name are all local), or "
                             "--host-discovery-script.")
    cooldown = args.blacklist_cooldown_range
    elastic = ElasticSettings(
        min_np=min_np, max_np=max_np, discovery_script=args.host_discovery_script,
        slots_per_host=args.slots,
        elastic_timeout=(read_env().elastic_timeout if args.elastic_timeout is None
                         else float(args.elastic_timeout)),
        reset_limit=args.reset_limit,
        cooldown_range=(float(cooldown[0]), float(cooldown[1])) if cooldown else None)
    ns = argparse.Namespace(**vars(args))
    ns.num_proc, ns.hosts, ns.hostfile = num_proc, ",".join(str(h) for h in hosts), None
    ns.use_gloo, ns.use_mpi = True, None
    settings = settings_from_args(ns, check_command=not args.host_discovery_script)
    assert settings.mode == MODE_TCP
    if cooldown:
        from .discovery import HostManager  # noqa: PLC0415
        HostManager(elastic.cooldown_range)  # validates the range
    return settings, elastic


def launch_elastic(settings: LaunchSettings, elastic: ElasticSettings) -> int:
    """Runs the job; returns hvdrun's exit code (the summary is already printed)."""
    from .discovery import DiscoveryError  # noqa: PLC0415
    from .launch import run_elastic  # noqa: PLC0415

    from ..cli import interrupted_exit  # noqa: PLC0415

    try:
        result = run_elastic(settings, elastic)
    except (DiscoveryError, ValueError, OSError) as exc:
        sys.stderr.write(f"hvdrun: error: {exc}\n")
        return 1
    except KeyboardInterrupt as exc:  # during the first host discovery
        return interrupted_exit(exc)
    return result.exit_code
