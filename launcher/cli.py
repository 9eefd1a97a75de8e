"""`hvdrun`: Horovod's `horovodrun` command line.

`hvdrun -np N [-H h1:2,h2:2 | --hostfile F] [--mpi | --tcp | --gloo] [flags] command...`

The tuning, autotune, timeline, stall, logging and library flags are generated from
`collective.config.OPTIONS` (each option's `cli` flag, `cli_scale` and env name), so the flags,
their environment variables and `--help` cannot drift apart. Flags left unset export nothing:
the worker then sees the launcher's environment or the option's default.

`--config-file` sets the flags a YAML file names, except those given on the command line
(before or after it): as in horovodrun, a flag beats the file, and the file beats the
environment.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import typing
from typing import Any, Callable, Iterator, Mapping, Sequence

from collective.config import OPTIONS, Option, options_by_field, out_of_range

from ._proc import catch_signals
from .hosts import HostInfo, parse_hostfile, parse_hosts
from .network import split_interfaces
from .settings import (MODE_MPI, MODE_TCP, LaunchSettings, default_mode,
                       start_timeout_or_env)

__all__ = ["main", "build_parser", "env_from_args", "settings_from_args", "ignored_flags",
           "YAML_KEYS", "FLAG_OPTIONS", "version", "SignalInterrupt", "interrupted_exit"]

FALLBACK_VERSION = "0.1.0"

# Which help group each generated flag belongs to (option field -> group title).
_GROUPS = {
    "fusion_threshold": "tuneable parameter arguments", "cycle_time_ms": "tuneable parameter arguments",
    "cache_capacity": "tuneable parameter arguments",
    "hierarchical_allreduce": "tuneable parameter arguments",
    "hierarchical_allgather": "tuneable parameter arguments",
    "torus_allreduce": "tuneable parameter arguments",
    "timeline": "timeline arguments", "timeline_mark_cycles": "timeline arguments",
    "stall_check_disable": "stall check arguments", "stall_check_time": "stall check arguments",
    "stall_shutdown_time": "stall check arguments",
    "log_level": "logging arguments", "log_hide_time": "logging arguments",
    "start_timeout": "general arguments", "elastic_timeout": "elastic arguments",
}
_AUTOTUNE_ONLY = {"autotune_log", "autotune_warmup_samples", "autotune_steps_per_sample",
                  "autotune_bayes_opt_max_samples", "autotune_gaussian_process_noise"}
# Booleans whose flag already says "off": no --no- form (Horovod's spelling).
_STORE_TRUE = {"log_hide_time", "mpi_threads_disable"}
_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

# Options with a flag, and the argparse dest of each (flag name minus dashes).
FLAG_OPTIONS: dict[str, Option] = {o.cli.lstrip("-").replace("-", "_"): o
                                   for o in OPTIONS if o.cli}

# YAML keys (horovodrun's) -> argparse dest; a leading "!" means the value is negated.
YAML_KEYS: dict[str, dict[str, str]] = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity",
               "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": "hierarchical_allgather",
               "torus_allreduce": "torus_allreduce"},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file",
                 "warmup_samples": "autotune_warmup_samples",
                 "steps_per_sample": "autotune_steps_per_sample",
                 "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                 "gaussian_process_noise": "autotune_gaussian_process_noise"},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "!no_stall_check",
                    "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {"mpi_threads_disable": "mpi_threads_disable",
                        "num_nccl_streams": "num_nccl_streams",
                        "thread_affinity": "thread_affinity",
                        "gloo_timeout_seconds": "gloo_timeout_seconds"},
    "logging": {"level": "log_level", "with_timestamp": "!log_without_timestamp"},
}


def version() -> str:
    """ringvod's version (package metadata, else the built-in constant)."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as _v
        try:
            return _v("ringvod")
        except PackageNotFoundError:
            return FALLBACK_VERSION
    except ImportError:  # pragma: no cover
        return FALLBACK_VERSION


def _is_bool(o: Option) -> bool:
    return isinstance(o.default, bool)


def _flag_type(o: Option) -> Callable[[str], Any]:
    if o.field == "log_level":
        return lambda s: s.upper()
    if o.type in (int, float, str):
        return o.type

    def parse(text: str) -> Any:  # argparse shows the parser's own message, not its name
        try:
            return o.type(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _coerce(dest: str, value: Any) -> Any:
    """Converts a YAML value to what the flag would have produced.

    Raises:
        ValueError: a value the flag would refuse (not a number, a log level not among the
            flag's choices, ...).
    """
    o = FLAG_OPTIONS.get(dest)
    if o is None or value is None:
        return value
    if _is_bool(o):
        return value if isinstance(value, bool) else o.type(str(value))
    converted = _flag_type(o)(str(value))
    if o.field == "log_level" and converted not in _LOG_LEVELS:
        raise ValueError(f"not a log level; use one of {', '.join(_LOG_LEVELS)} "
                         "(as --log-level)")
    return converted


def _given_on_command_line(namespace: argparse.Namespace) -> set[str]:
    """The dests a config file may set that the command line already set (every such flag
    defaults to None, so a value means the flag was given, `--no-x` included)."""
    dests = {d.lstrip("!") for keys in YAML_KEYS.values() for d in keys.values()}
    dests |= {"use_gloo", "use_mpi"}
    given = {d for d in dests if getattr(namespace, d, None) is not None}
    if getattr(namespace, "tcp_flag", False):  # a plain store_true flag (False when absent)
        given.add("tcp_flag")
    return given


def apply_config_file(path: str, namespace: argparse.Namespace,
                      keep: typing.AbstractSet[str] = frozenset()) -> None:
    """Sets the namespace fields named by a YAML config file (Horovod's keys).

    Args:
        keep: dests left alone (the flags given on the command line, which win over the
            file, as horovodrun's `set_args_from_config` skips its `override_args`); the file's
            `controller` is skipped when `use_gloo`, `use_mpi` or `tcp_flag` is in it.

    Raises:
        ImportError: PyYAML is not installed.
        OSError: the file cannot be read.
        ValueError: unknown keys or values of the wrong type.
    """
    try:
        import yaml  # noqa: PLC0415 - optional dependency, only for --config-file
    except ImportError as exc:
        raise ImportError("--config-file needs PyYAML: pip install pyyaml") from exc
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    for section, body in data.items():
        if section == "controller":
            mode = str(body).lower()
            if mode not in ("gloo", "tcp", "mpi"):
                raise ValueError(f"{path}: controller={body!r}; use gloo, tcp or mpi")
            # A mode flag on the command line wins; `--tcp` alone is one (tcp mode here).
            if not {"use_gloo", "use_mpi", "tcp_flag"} & set(keep):
                namespace.use_mpi = mode == "mpi"
                namespace.use_gloo = mode != "mpi"
            continue
        keys = YAML_KEYS.get(section)
        if keys is None:
            raise ValueError(f"{path}: unknown section {section!r}; known: controller, "
                             f"{', '.join(YAML_KEYS)}")
        if not isinstance(body, dict):
            raise ValueError(f"{path}: section {section!r} must be a mapping")
        for key, value in body.items():
            dest = keys.get(key)
            if dest is None:
                raise ValueError(f"{path}: unknown key {section}.{key}; known: "
                                 f"{', '.join(keys)}")
            negate = dest.startswith("!")
            dest = dest.lstrip("!")
            try:
                value = _coerce(dest, value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{path}: {section}.{key}={value!r}: {exc}") from None
            if dest not in keep:
                setattr(namespace, dest, (not value) if negate else value)


class _ControllerAction(argparse.Action):
    """`--gloo` / `--mpi`: selects that controller and deselects the other (either one, given
    anywhere on the command line, overrides a config file's `controller`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        namespace.use_gloo = self.dest == "use_gloo"
        namespace.use_mpi = self.dest == "use_mpi"


class _UnsupportedAction(argparse.Action):
    """A horovodrun flag that ringvod cannot honour: a usage error saying so (not argparse's
    bare "unrecognized arguments")."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: ringvod has no jsrun (IBM LSF) launch; use --mpi "
                     "(mpirun, e.g. inside an LSF allocation) or --gloo")


class _Parser(argparse.ArgumentParser):
    """Prints a usage error as the message and a one-line hint, not the whole usage block;
    applies `--config-file` once the whole command line is parsed, to the flags it left
    unset."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        path = getattr(ns, "config_file", None)
        if path:
            try:
                apply_config_file(str(path), ns, keep=_given_on_command_line(ns))
            except (OSError, ValueError, ImportError) as exc:
                self.error(str(exc))
        return ns, rest

    def error(self, message: str) -> "typing.NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"Usage: {self.prog} -np N [options] command ...   "
                     f"(`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The hvdrun argument parser (horovodrun's flags; tuning flags from the config table)."""
    p = _Parser(
        prog="hvdrun", description="Launch a ringvod (Horovod-compatible) job.",
        epilog="Each tuning flag sets the HOROVOD_* variable shown in its help.")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int,
                   help="total number of processes")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks and engines this installation supports, and exit")
    p.add_argument("--disable-cache", action="store_true",
                   help="accepted for compatibility; no effect (ringvod caches no ssh/NIC "
                        "checks), a warning says so")
    p.add_argument("--network-interfaces", dest="nics_deprecated", metavar="NICS",
                   help="comma list of network interfaces (deprecated: repeat "
                        "--network-interface)")
    p.add_argument("--network-interface", dest="nics", action="append", default=None,
                   metavar="NIC",
                   help="network interface for the job's traffic (repeatable; a comma list "
                        "such as eth0,eth1 also works)")
    p.add_argument("--output-filename",
                   help="tcp: write DIR/rank.<r>/stdout|stderr (output is also shown); "
                        "mpi: passed to mpirun")
    p.add_argument("--verbose", action="store_true", help="print the launch plan")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="do not print the start line (processes, mode, engines)")
    p.add_argument("--config-file",
                   help="YAML file of parameters (horovodrun's keys); a flag given on the "
                        "command line wins over the file, the file over the environment")
    g = p.add_argument_group("SSH arguments")
    g.add_argument("-p", "--ssh-port", type=int, help="ssh port on all hosts")
    g.add_argument("-i", "--ssh-identity-file", help="ssh private key file")

    groups: dict[str, argparse._ArgumentGroup] = {}
    for dest, o in FLAG_OPTIONS.items():
        title = _GROUPS.get(o.field)
        if title is None:
            title = ("autotune arguments" if o.field.startswith("autotune")
                     else "library arguments")
        grp = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
        scaled = bool(o.cli_scale) and o.cli_scale != 1
        default = f"{o.default / o.cli_scale:g} MB" if scaled else (
            f"{o.default!r}{' ' + o.unit if o.unit else ''}")
        helptext = f"{o.doc} (env {o.env}; default {default})"
        if o.cli.startswith("--no-") or o.field in _STORE_TRUE:
            grp.add_argument(o.cli, dest=dest, action="store_true", default=None, help=helptext)
        elif _is_bool(o):
            grp.add_argument(o.cli, dest=dest, action=argparse.BooleanOptionalAction,
                             default=None, help=helptext)
        else:
            kwargs: dict[str, Any] = {}
            if o.field == "log_level":
                kwargs["choices"] = _LOG_LEVELS
            else:
                kwargs["metavar"] = "MB" if scaled else (
                    "N" if o.type is int else "X" if o.type is float else "VALUE")
            grp.add_argument(o.cli, dest=dest, type=_flag_type(o), default=None,
                             help=helptext, **kwargs)

    # horovodrun's hidden opposites of the store-true flags (hidden there too): each sets the
    # flag's dest to False, so that the command line wins over a config file (`--stall-check`
    # beats `stall_check.enabled: false`). The two --log-hide-timestamp forms are its
    # deprecated spellings of --log-without-timestamp / --log-with-timestamp.
    for flag, dest, value in (("--stall-check", "no_stall_check", False),
                              ("--no-mpi-threads-disable", "mpi_threads_disable", False),
                              ("--log-with-timestamp", "log_without_timestamp", False),
                              ("--log-hide-timestamp", "log_without_timestamp", True),
                              ("--no-log-hide-timestamp", "log_without_timestamp", False)):
        p.add_argument(flag, dest=dest, action="store_const", const=value, default=None,
                       help=argparse.SUPPRESS)

    lib = groups.get("library arguments") or p.add_argument_group("library arguments")
    lib.add_argument("--mpi-args", help="extra arguments for mpirun (quoted)")
    lib.add_argument("--tcp", dest="tcp_flag", action="store_true",
                     help="ringvod: launch in tcp mode, like --gloo (no MPI); with --mpi: "
                          "Horovod's meaning, MPI over TCP only; in both, NCCL_IB_DISABLE=1 "
                          "for the ranks (as horovodrun)")
    lib.add_argument("--binding-args", help="process binding arguments for mpirun")
    logging = groups.get("logging arguments") or p.add_argument_group("logging arguments")
    logging.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                         dest="prefix_timestamp", action="store_true",
                         help="prefix each output line with a timestamp")

    el = groups.get("elastic arguments") or p.add_argument_group("elastic arguments")
    el.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=int,
                    help="elastic: the fewest processes the job runs with (default: -np)")
    el.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=int,
                    help="elastic (with --min-np or --host-discovery-script): the most "
                         "processes (default: every available slot)")
    el.add_argument("--slots-per-host", dest="slots", type=int,
                    help="elastic: slots of a host the discovery script names without ':N'")
    el.add_argument("--reset-limit", type=int,
                    help="elastic: stop the job after this many resets (default: no limit)")
    el.add_argument("--blacklist-cooldown-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                    help="elastic: a failed host comes back after a cooldown of MIN..MAX "
                         "seconds, growing with each failure (default: never)")

    hg = p.add_argument_group("host arguments").add_mutually_exclusive_group()
    hg.add_argument("-H", "--hosts", help="host list, e.g. host1:2,host2:4 (default "
                                          "localhost:<np>)")
    hg.add_argument("-hostfile", "--hostfile", help="file of 'hostname slots=N' lines")
    hg.add_argument("--host-discovery-script", help="elastic: script printing host:slots lines")

    cg = p.add_argument_group("controller arguments").add_mutually_exclusive_group()
    cg.add_argument("--gloo", dest="use_gloo", action=_ControllerAction, default=None,
                    help="tcp mode (Horovod's Gloo mode): spawn the workers here/over ssh "
                         "with a rendezvous server; no MPI needed")
    cg.add_argument("--mpi", dest="use_mpi", action=_ControllerAction, default=None,
                    help="MPI mode: run through mpirun (the default when mpi4py and mpirun "
                         "are installed)")
    cg.add_argument("--jsrun", action=_UnsupportedAction,
                    help="horovodrun's IBM LSF launch through jsrun: not supported in ringvod "
                         "(refused); use --mpi or --gloo")
    p.add_argument("command", nargs=argparse.REMAINDER, help="command to run")
    return p


# Second counts that horovodrun's flags take as ints (ringvod's as floats): a whole number is
# exported as horovodrun writes it ("30", not "30.0"), so worker code doing int(os.environ[...])
# keeps working.
_HOROVOD_INT_SECONDS = {"stall_check_time", "stall_shutdown_time", "gloo_timeout",
                        "start_timeout", "elastic_timeout"}


def _fmt(o: Option, value: Any) -> str:
    if _is_bool(o):
        return "1" if value else "0"
    if o.field in _HOROVOD_INT_SECONDS and float(value).is_integer():
        return str(int(value))
    if o.cli_scale and o.cli_scale != 1:
        return str(int(round(float(value) * o.cli_scale)))
    return str(value)


def _env_switch(environ: Mapping[str, str] | None, var: str) -> bool:
    """Whether hvdrun's environment turns autotune (`HOROVOD_AUTOTUNE`, an int > 0 or true) or
    the timeline (`HOROVOD_TIMELINE`, a path or DYNAMIC) on for the ranks, which inherit it."""
    raw = (os.environ if environ is None else environ).get(var, "").strip()
    if var != "HOROVOD_AUTOTUNE":
        return bool(raw)
    try:
        return bool(options_by_field()["autotune"].type(raw))
    except ValueError:  # the ranks warn about it and read it as off
        return False


def autotune_on(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """Autotune runs in the job: `--autotune` (or the config file's `autotune.enabled`), or,
    with neither that nor `--no-autotune`, HOROVOD_AUTOTUNE in hvdrun's environment."""
    flag = getattr(args, "autotune", None)
    return bool(flag) if flag is not None else _env_switch(environ, "HOROVOD_AUTOTUNE")


def timeline_on(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """The job writes a timeline: `--timeline-filename`, or else HOROVOD_TIMELINE in hvdrun's
    environment."""
    name = getattr(args, "timeline_filename", None)
    return bool(name) if name is not None else _env_switch(environ, "HOROVOD_TIMELINE")


def env_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                  ) -> dict[str, str]:
    """HOROVOD_* variables for the flags that were set (Horovod's `set_env_from_args`).

    Autotune variables are exported only when autotune is on, timeline ones only when the
    timeline is: by the flag (`--autotune`, `--timeline-filename`) or, unlike horovodrun,
    which drops them then, by HOROVOD_AUTOTUNE / HOROVOD_TIMELINE in `environ` (default:
    hvdrun's environment), which the ranks inherit. `main` warns about the flags dropped
    (`ignored_flags`).

    Raises:
        ValueError: `<arg>=<v> must be >= 0`, a float flag is not finite (nan, inf), or the
            Gaussian process noise is outside [0, 1].
    """
    env: dict[str, str] = {}
    autotune = autotune_on(args, environ)
    timeline = timeline_on(args, environ)
    for dest, o in FLAG_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        why = out_of_range(o, value)
        if why:
            raise ValueError(f"{dest}={value} {why}")
        if o.field in _AUTOTUNE_ONLY and not autotune:
            continue
        if o.field == "timeline_mark_cycles" and not timeline:
            continue
        env[o.env] = _fmt(o, value)
    return env


def _flag(field: str) -> str:
    return next(o.cli for o in FLAG_OPTIONS.values() if o.field == field)


def _given(args: argparse.Namespace, dest: str) -> bool:
    """A flag that was set to something that would matter (`--no-x`, False, asks nothing)."""
    value = getattr(args, dest, None)
    return value is not None and value is not False and value != ""


_ELASTIC_ONLY = (("max_num_proc", "--max-np"), ("slots", "--slots-per-host"),
                 ("reset_limit", "--reset-limit"),
                 ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
                 ("elastic_timeout", "--elastic-timeout"))
_MPI_ONLY = (("mpi_args", "--mpi-args"), ("binding_args", "--binding-args"),
             ("mpi_threads_disable", "--mpi-threads-disable"))
_TCP_ONLY = (("gloo_timeout_seconds", "--gloo-timeout-seconds"),)


def ignored_flags(args: argparse.Namespace, mode: str, elastic: bool,
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning line per flag that was given but has no effect, because the flag or mode it
    only works with is absent. horovodrun drops them silently; they stay accepted (scripts
    written for it keep working), so this only tells.

    Args:
        mode: the job's mode (`MODE_TCP` or `MODE_MPI`).
        elastic: an elastic job (`--min-np` or `--host-discovery-script`).
        environ: hvdrun's environment (default `os.environ`): HOROVOD_AUTOTUNE /
            HOROVOD_TIMELINE there switch autotune / the timeline on as the flags do.
    """
    out = []

    def warn(flag: str, why: str) -> None:
        out.append(f"hvdrun: warning: ignoring {flag}: {why}")

    if not autotune_on(args, environ):
        why = ("autotune is switched off (--no-autotune, or autotune.enabled: false in "
               "--config-file)" if getattr(args, "autotune", None) is False
               else "it only applies with --autotune (or HOROVOD_AUTOTUNE=1 in hvdrun's "
               "environment)")
        for dest, o in FLAG_OPTIONS.items():
            if o.field in _AUTOTUNE_ONLY and _given(args, dest):
                warn(o.cli, why)
    if _given(args, "timeline_mark_cycles") and not timeline_on(args, environ):
        warn(_flag("timeline_mark_cycles"), "it only applies with --timeline-filename (or "
                                            "HOROVOD_TIMELINE in hvdrun's environment)")
    if _given(args, "no_stall_check"):
        for field in ("stall_check_time", "stall_shutdown_time"):
            dest = _flag(field).lstrip("-").replace("-", "_")
            if _given(args, dest):
                warn(_flag(field), "--no-stall-check turns the stall check off")
    if not elastic:
        for dest, flag in _ELASTIC_ONLY:
            if _given(args, dest):
                warn(flag, "it only applies to elastic jobs (--host-discovery-script or "
                           "--min-np); this job is static, as with horovodrun")
    elif _given(args, "slots") and not _given(args, "host_discovery_script"):
        warn("--slots-per-host", "it only applies with --host-discovery-script (give the "
                                 "slots of -H/--hostfile hosts there, as host:N)")
    if _given(args, "disable_cache"):
        warn("--disable-cache", "ringvod caches no ssh/NIC checks, so there is nothing to "
                                "disable")
    if mode == MODE_TCP:
        for dest, flag in _MPI_ONLY:
            if _given(args, dest):
                warn(flag, "it only applies in MPI mode (--mpi); this job runs in tcp mode")
    else:
        for dest, flag in _TCP_ONLY:
            if _given(args, dest):
                warn(flag, "it only applies in tcp mode (--gloo/--tcp); this job runs in MPI "
                           "mode")
    return out


def _hosts(args: argparse.Namespace) -> list[HostInfo]:
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    return [HostInfo("localhost", args.num_proc)]


def _mode(args: argparse.Namespace) -> str:
    if args.use_mpi:
        return MODE_MPI
    if args.use_gloo or args.tcp_flag:
        return MODE_TCP
    return default_mode()


def resolve_command(command: list[str], hosts: Sequence[HostInfo] | None = ()
                    ) -> list[str]:
    """The command as both modes run it.

    A Python file given without an interpreter (`hvdrun -np 2 train.py`) runs with this
    Python, as `python train.py` would. A command that is neither a file nor on PATH is refused
    up front with a message naming it, when every host is local (a remote host may have it;
    `hosts=None`: the hosts are not known yet, so nothing is checked).

    Raises:
        ValueError: the command cannot be found.
    """
    if not command:
        return command
    exe = command[0]
    if exe.endswith(".py") and os.path.isfile(exe) and not (
            "/" in exe and os.access(exe, os.X_OK)):
        return [sys.executable, *command]
    local = hosts is not None and all(h.hostname in ("localhost", "127.0.0.1") for h in hosts)
    if local and shutil.which(exe) is None and not ("/" in exe and os.path.exists(exe)):
        if exe.endswith(".py"):
            raise ValueError(f"cannot run {exe!r}: no such file in {os.getcwd()}")
        raise ValueError(f"cannot run {exe!r}: no such file, and no command of that name on "
                         "PATH")
    return command


def check_slots_per_host(args: argparse.Namespace) -> None:
    """Refuses `--slots-per-host` below 1 (an elastic job would wait for hosts of 0 slots, that
    it never uses, until --elastic-timeout).

    Raises:
        ValueError: the message names the flag.
    """
    slots = getattr(args, "slots", None)
    if slots is not None and slots < 1:
        raise ValueError(f"--slots-per-host must be at least 1 (got {slots}): it is the number "
                         "of slots of each host the discovery script names without ':N'")


def settings_from_args(args: argparse.Namespace, *, check_command: bool = True
                       ) -> LaunchSettings:
    """Validates parsed arguments into `LaunchSettings`.

    Args:
        check_command: refuse a command that all-local hosts cannot run (off when the hosts
            come later from a discovery script).

    Raises:
        ValueError: a missing or invalid value (message says which and how to fix it).
        OSError: the hostfile cannot be read.
    """
    if args.num_proc is None:
        raise ValueError("the number of processes is required: -np N")
    if not args.command:
        raise ValueError("no command to run; usage: hvdrun -np N [options] command ...")
    if args.num_proc < 1:
        raise ValueError(f"-np must be at least 1 (got {args.num_proc})")
    if args.ssh_port is not None and args.ssh_port < 0:
        raise ValueError(f"ssh_port={args.ssh_port} must be >= 0")
    check_slots_per_host(args)
    env = env_from_args(args)
    if args.tcp_flag:
        # horovodrun's `--tcp` sets NCCL_IB_DISABLE=1 for the workers whatever the controller
        # (its set_env_from_args): NCCL then stays off InfiniBand in tcp mode too.
        env["NCCL_IB_DISABLE"] = "1"
    start_timeout = start_timeout_or_env(args.start_timeout)
    nics = split_interfaces([args.nics_deprecated or "", *(args.nics or [])])
    mode = _mode(args)
    hosts = tuple(_hosts(args))
    return LaunchSettings(
        num_proc=args.num_proc, hosts=hosts, mode=mode,
        command=tuple(resolve_command(list(args.command), hosts if check_command else None)),
        env_overrides=env, start_timeout=start_timeout,
        ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
        network_interfaces=tuple(nics), output_filename=args.output_filename,
        verbose=args.verbose, prefix_timestamp=args.prefix_timestamp, mpi_args=args.mpi_args,
        binding_args=args.binding_args, tcp_only=bool(args.tcp_flag and mode == MODE_MPI))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hvdrun` / `python -m launcher`; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.version:
        print(version())
        return 0
    if args.check_build:
        from .check_build import check_build_text  # noqa: PLC0415
        print(check_build_text(version()))
        return 0
    # Elastic as horovodrun decides it: `--max-np` alone leaves a static job (and is ignored,
    # with a warning).
    if args.min_num_proc is not None or args.host_discovery_script:
        from .elastic.cli import elastic_settings_from_args, launch_elastic  # noqa: PLC0415
        try:
            settings, elastic = elastic_settings_from_args(args)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        _warn_ignored(args, settings.mode, elastic=True)
        with _signals_interrupt():
            return launch_elastic(settings, elastic)
    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    _warn_ignored(args, settings.mode, elastic=False)
    with _signals_interrupt():
        return _launch(settings, quiet=args.quiet)


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM or SIGHUP while `hvdrun` starts a job (ssh check, discovery script, mpirun
    detection), before the job's own handlers take over: raised as Ctrl-C raises
    KeyboardInterrupt, so that what the start phase runs is stopped on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP raise `SignalInterrupt` in here (main thread only). A default SIGTERM
    killed hvdrun at once, leaving an ssh probe running until --start-timeout and a slow
    discovery script running on, owned by init."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise SignalInterrupt(signum)

    old = catch_signals(interrupt, (signal.SIGTERM, signal.SIGHUP))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def interrupted_exit(exc: KeyboardInterrupt) -> int:
    """Says that hvdrun stopped before the workers started; returns 128 + the signal."""
    signum = getattr(exc, "signum", int(signal.SIGINT))
    sys.stderr.write(f"hvdrun: received {signal.Signals(signum).name} before the job started; "
                     "stopped.\n")
    return 128 + signum


# Variables hvdrun sets for its workers from the job's mode (launch._TOPOLOGY_VARS drops the
# launcher's own values, so that a nested launch does not inherit a parent job's).
_MODE_VARS = ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS")


def ignored_environment(environ: Mapping[str, str], mode: str) -> list[str]:
    """One warning line per mode variable (`HOROVOD_CONTROLLER`, `HOROVOD_CPU_OPERATIONS`) set
    in hvdrun's own environment: hvdrun does not pass them on, it sets the workers' controller
    from the job's mode. Inside a running job's worker (`HOROVOD_RANK` set) they are the outer
    job's and dropped without a word."""
    if "HOROVOD_RANK" in environ:
        return []
    where = "tcp mode (--gloo/--tcp)" if mode == MODE_TCP else "MPI mode (--mpi)"
    return [f"hvdrun: warning: ignoring {var}={environ[var]} from the environment: hvdrun "
            f"sets its workers' controller and host operations from the job's mode (this job "
            f"runs in {where})" for var in _MODE_VARS if environ.get(var)]


def _warn_ignored(args: argparse.Namespace, mode: str, elastic: bool) -> None:
    lines = ignored_flags(args, mode, elastic) + ignored_environment(os.environ, mode)
    if lines:
        sys.stderr.write("".join(line + "\n" for line in lines))
        sys.stderr.flush()


def start_line(settings: LaunchSettings, mpi_text: str = "") -> str:
    """One line naming the processes, the mode and the engines (hvdrun prints it unless -q)."""
    import importlib.util  # noqa: PLC0415

    hosts = len(settings.used_hosts)
    where = f" on {hosts} hosts" if hosts > 1 else ""
    if settings.mode == MODE_MPI:
        mode = f"MPI mode ({mpi_text})" if mpi_text else "MPI mode"
        host_ops = "host ops over MPI"
    else:
        mode, host_ops = "tcp mode", "host ops over TCP"
    gpu = ("GPU ops over NCCL" if importlib.util.find_spec("cupy") is not None
           else "no GPU ops (CuPy not installed)")
    n = settings.num_proc
    return f"hvdrun: {n} process{'es' if n != 1 else ''}{where}, {mode}, {host_ops}, {gpu}"


def _launch(settings: LaunchSettings, quiet: bool = False) -> int:
    from . import launch  # noqa: PLC0415 - keeps `hvdrun --help` light
    from .mpi_job import run_mpi_job  # noqa: PLC0415
    from .mpirun import MPIUnavailableError  # noqa: PLC0415
    from .process import failure_summary  # noqa: PLC0415
    from .ssh import SSHCheckError, StartTimeoutError  # noqa: PLC0415

    try:
        if settings.mode == MODE_MPI:
            argv, env = launch.mpi_command(settings)
            if settings.verbose:
                sys.stderr.write(launch.describe_plan(
                    settings, launch.network.local_addresses()) + "\n")
            if not quiet:
                sys.stderr.write(start_line(settings, launch.detected_mpi_text()) + "\n")
                sys.stderr.flush()
            launch.check_remote_hosts(settings)
            return run_mpi_job(settings, argv, env)
        if not quiet:
            sys.stderr.write(start_line(settings) + "\n")
            sys.stderr.flush()
        result = launch.run_tcp(settings)
    except (StartTimeoutError, SSHCheckError, MPIUnavailableError, ValueError, OSError) as exc:
        sys.stderr.write(f"hvdrun: error: {exc}\n")
        return 1
    except KeyboardInterrupt as exc:  # before any worker started (ssh check, mpirun detection)
        return interrupted_exit(exc)
    if result.failure is not None and result.interrupted_by is None:
        sys.stderr.write(failure_summary(result.failure))
    return result.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
