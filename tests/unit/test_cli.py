"""hvdrun's pure parts: flag -> env mapping, config files, worker env, ssh and mpirun commands."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

import pytest

from collective.config import OPTIONS
from launcher import cli
from launcher.env import exportable_env, is_exportable, redact, worker_env
from launcher.hosts import HostInfo, SlotInfo, parse_hostfile_text, parse_hosts
from launcher.mpirun import (MPIImpl, MPIUnavailableError, build_mpirun_command,
                             parse_mpi_version)
from launcher.settings import LaunchSettings
from launcher.ssh import remote_command, ssh_base, timeout_message


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv) + ["python", "x.py"])


def env_of(*argv: str) -> dict[str, str]:
    return cli.env_from_args(parse(*argv))


def _sample(o) -> tuple[list[str], str]:
    """A command-line value for an option and the env value it must produce."""
    if o.cli.startswith("--no-") or o.field in ("log_hide_time", "mpi_threads_disable"):
        return [o.cli], "1"
    if o.type is int:
        return [o.cli, "3"], str(int(3 * o.cli_scale))
    if o.type is float:
        return [o.cli, "0.5"], "0.5"
    if o.field == "thread_affinity":
        return [o.cli, "0,1"], "0,1"
    if o.type is str:
        if o.field == "log_level":
            return [o.cli, "debug"], "DEBUG"
        return [o.cli, "some-value"], "some-value"
    return [o.cli], "1"  # --flag of a --[no-]flag pair


FLAGGED = [o for o in OPTIONS if o.cli]


def test_every_table_flag_exists():
    names = {s for a in cli.build_parser()._actions for s in a.option_strings}
    missing = [o.cli for o in FLAGGED if o.cli not in names]
    assert not missing
    for flag in ("--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity",
                 "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--autotune",
                 "--timeline-filename", "--no-stall-check", "--log-level",
                 "--log-without-timestamp", "--gloo-timeout-seconds", "--start-timeout",
                 "-np", "-H", "-hostfile", "--hostfile", "-p", "-i", "-cb", "-v",
                 "--output-filename", "--config-file", "--mpi-args", "--binding-args", "--tcp",
                 "--gloo", "--mpi", "-prefix-timestamp", "--network-interface",
                 "--network-interfaces", "--verbose"):
        assert flag in names, flag


@pytest.mark.parametrize("o", FLAGGED, ids=[o.cli for o in FLAGGED])
def test_flag_sets_its_env_var(o):
    argv, expected = _sample(o)
    extra = []
    if o.field.startswith("autotune") and o.field != "autotune":
        extra = ["--autotune"]  # autotune env is exported only with --autotune
    if o.field == "timeline_mark_cycles":
        extra = ["--timeline-filename", "/tmp/t.json"]
    env = env_of(*extra, *argv)
    assert env[o.env] == expected


def test_unset_flags_export_nothing():
    assert env_of() == {}


def test_fusion_threshold_scale_and_no_bool_forms():
    assert env_of("--fusion-threshold-mb", "64")["HOROVOD_FUSION_THRESHOLD"] == str(64 << 20)
    assert env_of("--no-hierarchical-allreduce")["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "0"
    assert env_of("--hierarchical-allgather")["HOROVOD_HIERARCHICAL_ALLGATHER"] == "1"
    assert env_of("--no-stall-check")["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert env_of("--log-without-timestamp")["HOROVOD_LOG_HIDE_TIME"] == "1"


def test_whole_second_counts_export_as_horovodrun_writes_them():
    # horovodrun's flags take these as ints and export "30"; worker code may int() them.
    env = env_of("--stall-check-warning-time-seconds", "5", "--stall-check-shutdown-time-seconds",
                 "9", "--gloo-timeout-seconds", "30", "--start-timeout", "20")
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "5"
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "9"
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "30"
    assert env["HOROVOD_START_TIMEOUT"] == "20"
    assert env_of("--gloo-timeout-seconds", "2.5")["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "2.5"
    assert env_of("--cycle-time-ms", "7")["HOROVOD_CYCLE_TIME"] == "7.0"  # a float there too


def test_autotune_and_timeline_gating():
    env = env_of("--autotune-warmup-samples", "5", "--timeline-mark-cycles")
    assert "HOROVOD_AUTOTUNE_WARMUP_SAMPLES" not in env
    assert "HOROVOD_TIMELINE_MARK_CYCLES" not in env
    env = env_of("--autotune", "--autotune-warmup-samples", "5", "--timeline-filename", "t.json",
                 "--timeline-mark-cycles")
    assert env["HOROVOD_AUTOTUNE"] == "1"
    assert env["HOROVOD_AUTOTUNE_WARMUP_SAMPLES"] == "5"
    assert env["HOROVOD_TIMELINE"] == "t.json"
    assert env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"


# Flags that only work with another flag (or in one mode): given without it, hvdrun ignores
# them as horovodrun does, but says so on stderr, one line each.
IGNORED = [
    (["--autotune-log-file", "a.csv"], "tcp", False, "--autotune-log-file", "--autotune"),
    (["--autotune-warmup-samples", "0"], "tcp", False, "--autotune-warmup-samples",
     "--autotune"),
    (["--no-autotune", "--autotune-steps-per-sample", "4"], "tcp", False,
     "--autotune-steps-per-sample", "--no-autotune"),
    (["--autotune-bayes-opt-max-samples", "4"], "mpi", False,
     "--autotune-bayes-opt-max-samples", "--autotune"),
    (["--autotune-gaussian-process-noise", "0.5"], "tcp", False,
     "--autotune-gaussian-process-noise", "--autotune"),
    (["--timeline-mark-cycles"], "tcp", False, "--timeline-mark-cycles",
     "--timeline-filename"),
    (["--no-stall-check", "--stall-check-warning-time-seconds", "5"], "tcp", False,
     "--stall-check-warning-time-seconds", "--no-stall-check"),
    (["--stall-check-shutdown-time-seconds", "9", "--no-stall-check"], "mpi", False,
     "--stall-check-shutdown-time-seconds", "--no-stall-check"),
    (["--slots-per-host", "2"], "tcp", False, "--slots-per-host", "--host-discovery-script"),
    (["--reset-limit", "3"], "mpi", False, "--reset-limit", "--min-np"),
    (["--max-np", "8"], "tcp", False, "--max-np", "--host-discovery-script or --min-np"),
    (["--blacklist-cooldown-range", "1", "5"], "tcp", False, "--blacklist-cooldown-range",
     "elastic"),
    (["--elastic-timeout", "60"], "tcp", False, "--elastic-timeout", "elastic"),
    (["--min-np", "1", "-H", "a:1,b:1", "--slots-per-host", "2"], "tcp", True,
     "--slots-per-host", "--host-discovery-script"),
    (["--mpi-args", "-x FOO"], "tcp", False, "--mpi-args", "MPI mode"),
    (["--binding-args", "-bind-to none"], "tcp", False, "--binding-args", "MPI mode"),
    (["--mpi-threads-disable"], "tcp", True, "--mpi-threads-disable", "MPI mode"),
    (["--gloo-timeout-seconds", "5"], "mpi", False, "--gloo-timeout-seconds", "tcp mode"),
    (["--disable-cache"], "tcp", False, "--disable-cache", "caches no ssh/NIC checks"),
    (["--disable-cache"], "mpi", True, "--disable-cache", "caches no ssh/NIC checks"),
]


@pytest.mark.parametrize("argv,mode,elastic,flag,needs", IGNORED,
                         ids=[" ".join(c[0]) for c in IGNORED])
def test_flags_ignored_without_their_companion_warn(argv, mode, elastic, flag, needs):
    lines = cli.ignored_flags(parse(*argv), mode, elastic, environ={})
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hvdrun: warning: ignoring {flag}: "), lines
    assert needs in lines[0] and "\n" not in lines[0], lines


def test_flags_with_their_companion_do_not_warn():
    for argv, mode, elastic in (
            (["--autotune", "--autotune-log-file", "a.csv", "--autotune-warmup-samples", "0",
              "--autotune-gaussian-process-noise", "0.5"], "tcp", False),
            (["--timeline-filename", "t.json", "--timeline-mark-cycles"], "tcp", False),
            (["--no-timeline-mark-cycles"], "tcp", False),  # off, as without a timeline
            (["--stall-check-warning-time-seconds", "5",
              "--stall-check-shutdown-time-seconds", "9"], "mpi", False),
            (["--host-discovery-script", "d.sh", "--slots-per-host", "2", "--reset-limit", "3",
              "--blacklist-cooldown-range", "1", "5", "--elastic-timeout", "60",
              "--gloo-timeout-seconds", "5"], "tcp", True),
            (["--mpi", "--mpi-args", "-x FOO", "--binding-args", "-bind-to none",
              "--mpi-threads-disable"], "mpi", False),
            (["--gloo-timeout-seconds", "5", "--start-timeout", "9"], "tcp", False),
            (["--mpi", "--start-timeout", "9"], "mpi", False),  # bounds the ssh check too
            ([], "tcp", False), ([], "mpi", False)):
        assert cli.ignored_flags(parse(*argv), mode, elastic, environ={}) == [], argv


@pytest.mark.parametrize("var,value", [("HOROVOD_AUTOTUNE", "1"), ("HOROVOD_AUTOTUNE", "true"),
                                       ("HOROVOD_TIMELINE", "/tmp/tl.json"),
                                       ("HOROVOD_TIMELINE", "DYNAMIC")])
def test_companion_flags_apply_when_the_environment_switches_the_feature_on(
        monkeypatch, capsys, var, value):
    """HOROVOD_AUTOTUNE / HOROVOD_TIMELINE in hvdrun's environment reach every rank, so autotune
    or the timeline is on: --autotune-* / --timeline-mark-cycles then apply. They used to be
    dropped with a warning saying they 'only apply with --autotune', which was untrue."""
    monkeypatch.setenv(var, value)
    seen = []
    monkeypatch.setattr(cli, "_launch", lambda settings, quiet=False: seen.append(settings)
                        or 0)
    assert cli.main(["-np", "1", "--tcp", "--autotune-log-file", "a.csv",
                     "--autotune-warmup-samples", "2", "--timeline-mark-cycles", "-q",
                     "true"]) == 0
    err = capsys.readouterr().err
    env = seen[0].env_overrides
    if var == "HOROVOD_AUTOTUNE":
        assert env["HOROVOD_AUTOTUNE_LOG"] == "a.csv"
        assert env["HOROVOD_AUTOTUNE_WARMUP_SAMPLES"] == "2"
        assert "HOROVOD_TIMELINE_MARK_CYCLES" not in env
        assert "--autotune" not in err and "ignoring --timeline-mark-cycles" in err, err
    else:
        assert env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
        assert "HOROVOD_AUTOTUNE_LOG" not in env
        assert "--timeline-mark-cycles" not in err and "ignoring --autotune-log-file" in err, err


def test_companion_flags_dropped_say_why(monkeypatch):
    """Off in the environment (0) or by --no-autotune (which beats HOROVOD_AUTOTUNE=1 and
    exports HOROVOD_AUTOTUNE=0): the warning names both routes, or the flag that turned it
    off."""
    off = {"HOROVOD_AUTOTUNE": "0", "HOROVOD_TIMELINE": ""}
    assert cli.ignored_flags(parse("--autotune-log-file", "a.csv", "--timeline-mark-cycles"),
                             "tcp", False, environ=off) == [
        "hvdrun: warning: ignoring --autotune-log-file: it only applies with --autotune (or "
        "HOROVOD_AUTOTUNE=1 in hvdrun's environment)",
        "hvdrun: warning: ignoring --timeline-mark-cycles: it only applies with "
        "--timeline-filename (or HOROVOD_TIMELINE in hvdrun's environment)"]
    on = {"HOROVOD_AUTOTUNE": "1"}
    args = parse("--no-autotune", "--autotune-log-file", "a.csv")
    assert cli.ignored_flags(args, "tcp", False, environ=on) == [
        "hvdrun: warning: ignoring --autotune-log-file: autotune is switched off "
        "(--no-autotune, or autotune.enabled: false in --config-file)"]
    env = cli.env_from_args(args, environ=on)
    assert env["HOROVOD_AUTOTUNE"] == "0" and "HOROVOD_AUTOTUNE_LOG" not in env


@pytest.mark.parametrize("slots", ["0", "-2"])
@pytest.mark.parametrize("where", [["--host-discovery-script", "./d.sh"],
                                   ["--min-np", "2", "-H", "a:1,b:1"], []])
def test_slots_per_host_below_one_is_refused(capsys, slots, where):
    """--slots-per-host 0 was accepted: the hosts the script names without ':N' got 0 slots and
    the job waited for slots until --elastic-timeout. -2 was refused as 'slots_per_host=-2'."""
    with pytest.raises(SystemExit) as e:
        cli.main(["-np", "2", *where, "--slots-per-host", slots, "true"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"hvdrun: error: --slots-per-host must be at least 1 (got {slots})" in err, err


def test_ignored_flags_are_warned_not_refused(monkeypatch, capsys):
    """hvdrun still runs the job (horovodrun's scripts keep working), the env still gated."""
    seen = []
    monkeypatch.setattr(cli, "_launch", lambda settings, quiet=False: seen.append(settings)
                        or 0)
    monkeypatch.delenv("HOROVOD_AUTOTUNE", raising=False)
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    assert cli.main(["-np", "1", "--tcp", "--autotune-log-file", "a.csv",
                     "--timeline-mark-cycles", "--mpi-args", "-x A", "-q", "true"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["hvdrun: warning: ignoring --autotune-log-file: it only applies with "
                   "--autotune (or HOROVOD_AUTOTUNE=1 in hvdrun's environment)",
                   "hvdrun: warning: ignoring --timeline-mark-cycles: it only applies with "
                   "--timeline-filename (or HOROVOD_TIMELINE in hvdrun's environment)",
                   "hvdrun: warning: ignoring --mpi-args: it only applies in MPI mode (--mpi); "
                   "this job runs in tcp mode"]
    assert seen and "HOROVOD_AUTOTUNE_LOG" not in seen[0].env_overrides
    assert "HOROVOD_TIMELINE_MARK_CYCLES" not in seen[0].env_overrides


def test_mode_variables_in_hvdruns_environment_are_warned(monkeypatch, capsys):
    """HOROVOD_CONTROLLER / HOROVOD_CPU_OPERATIONS set for hvdrun are not passed on (the mode
    decides): one warning line each, none inside a running job's worker."""
    from launcher import launch
    monkeypatch.setattr(cli, "_launch", lambda settings, quiet=False: 0)
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "gloo")
    monkeypatch.setenv("HOROVOD_CONTROLLER", "mpi")
    assert cli.main(["-np", "1", "--tcp", "-q", "true"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"hvdrun: warning: ignoring {var} from the environment: hvdrun sets its workers' "
        "controller and host operations from the job's mode (this job runs in tcp mode "
        "(--gloo/--tcp))" for var in ("HOROVOD_CONTROLLER=mpi", "HOROVOD_CPU_OPERATIONS=gloo")]
    assert "HOROVOD_CPU_OPERATIONS" not in launch._parent_env()
    monkeypatch.setenv("HOROVOD_RANK", "0")  # hvdrun started by a worker of an outer job
    assert cli.main(["-np", "1", "--tcp", "-q", "true"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.ignored_environment({"HOROVOD_CPU_OPERATIONS": "mpi"}, "mpi") == [
        "hvdrun: warning: ignoring HOROVOD_CPU_OPERATIONS=mpi from the environment: hvdrun sets "
        "its workers' controller and host operations from the job's mode (this job runs in MPI "
        "mode (--mpi))"]


def test_ignored_flags_of_an_elastic_job_are_warned(monkeypatch, capsys):
    import launcher.elastic.cli as elastic_cli
    seen = []
    monkeypatch.setattr(elastic_cli, "launch_elastic",
                        lambda settings, elastic: seen.append(elastic) or 0)
    assert cli.main(["-np", "2", "--min-np", "1", "-H", "a:1,b:1", "--slots-per-host", "4",
                     "--reset-limit", "2", "true"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "hvdrun: warning: ignoring --slots-per-host: it only applies with "
        "--host-discovery-script (give the slots of -H/--hostfile hosts there, as host:N)"]
    assert seen[0].reset_limit == 2


def test_max_np_alone_runs_a_static_job(monkeypatch, capsys):
    # horovodrun is elastic only with --host-discovery-script or --min-np: `-np 2 --max-np 4`
    # is a static job of 2 (ringvod started an elastic job there).
    import launcher.elastic.cli as elastic_cli
    static, elastic = [], []
    monkeypatch.setattr(cli, "_launch", lambda settings, quiet=False: static.append(settings) or 0)
    monkeypatch.setattr(elastic_cli, "launch_elastic",
                        lambda settings, el: elastic.append(el) or 0)
    assert cli.main(["-np", "2", "--max-np", "4", "true"]) == 0
    assert elastic == [] and static[0].num_proc == 2
    assert capsys.readouterr().err.splitlines() == [
        "hvdrun: warning: ignoring --max-np: it only applies to elastic jobs "
        "(--host-discovery-script or --min-np); this job is static, as with horovodrun"]
    assert cli.main(["-np", "2", "--min-np", "1", "--max-np", "4", "-H", "a:2,b:2", "true"]) == 0
    assert elastic[0].max_np == 4 and len(static) == 1


def test_horovod_run_max_num_proc_alone_is_static(monkeypatch):
    from launcher import api
    seen = {}
    monkeypatch.setattr(api, "_run_tcp", lambda settings, blob: seen.setdefault("s", settings))
    monkeypatch.setattr(api, "_run_elastic", lambda *a, **k: seen.setdefault("elastic", True))
    with pytest.warns(RuntimeWarning, match=r"max_num_proc=.*has no effect unless the run is "
                                             r"elastic \(min_num_proc or host_discovery_script"):
        api.run(print, num_proc=2, max_num_proc=4, use_gloo=True)
    assert "elastic" not in seen and seen["s"].num_proc == 2


def test_config_file_values_without_their_companion_warn(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "c.yaml"
    f.write_text("autotune:\n  enabled: false\n  log_file: a.csv\n"
                 "timeline:\n  mark_cycles: true\n")
    lines = cli.ignored_flags(parse("--config-file", str(f)), "tcp", False)
    assert [line.split(":")[2].strip() for line in lines] == [
        "ignoring --autotune-log-file", "ignoring --timeline-mark-cycles"]


@pytest.mark.parametrize("flag,dest", [("--fusion-threshold-mb", "fusion_threshold_mb"),
                                       ("--cycle-time-ms", "cycle_time_ms"),
                                       ("--cache-capacity", "cache_capacity"),
                                       ("--stall-check-warning-time-seconds",
                                        "stall_check_warning_time_seconds"),
                                       ("--gloo-timeout-seconds", "gloo_timeout_seconds"),
                                       ("--start-timeout", "start_timeout")])
def test_negative_values_rejected(flag, dest):
    with pytest.raises(ValueError, match=f"^{dest}=-1(.0)? must be >= 0$"):
        env_of(flag, "-1")


@pytest.mark.parametrize("raw", ["nan", "inf"])
@pytest.mark.parametrize("flag,dest", [("--cycle-time-ms", "cycle_time_ms"),
                                       ("--stall-check-warning-time-seconds",
                                        "stall_check_warning_time_seconds"),
                                       ("--stall-check-shutdown-time-seconds",
                                        "stall_check_shutdown_time_seconds"),
                                       ("--bucket-cap-mb", "bucket_cap_mb"),
                                       ("--gloo-timeout-seconds", "gloo_timeout_seconds"),
                                       ("--start-timeout", "start_timeout")])
def test_non_finite_values_rejected(flag, dest, raw):
    with pytest.raises(ValueError, match=f"^{dest}={raw} must be a finite number$"):
        env_of(flag, raw)


def test_gaussian_noise_range():
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        env_of("--autotune", "--autotune-gaussian-process-noise", "1.5")


def test_cli_main_reports_errors_as_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["-np", "2", "--cycle-time-ms", "-3", "true"])
    assert e.value.code == 2
    assert "cycle_time_ms=-3.0 must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["true"])
    assert "-np" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["-np", "2", "--min-np", "1", "true"])  # elastic on one host
    assert "Elastic jobs need -H with two hosts" in capsys.readouterr().err


def test_version_and_settings(capsys):
    assert cli.main(["-v"]) == 0
    assert capsys.readouterr().out.strip() == cli.version()
    s = cli.settings_from_args(parse("-np", "3", "-H", "a:2,b:2", "--gloo", "-p", "2222"))
    assert s.mode == "tcp" and s.num_proc == 3 and s.ssh_port == 2222
    assert s.used_hosts == (HostInfo("a", 2), HostInfo("b", 1))
    assert cli.settings_from_args(parse("-np", "1", "--mpi")).mode == "mpi"
    s = cli.settings_from_args(parse("-np", "1", "--mpi", "--tcp"))
    assert s.mode == "mpi" and s.tcp_only
    s = cli.settings_from_args(parse("-np", "1", "--tcp", "--network-interfaces", "eth0,eth1",
                                     "--network-interface", "ib0"))
    assert s.mode == "tcp" and not s.tcp_only
    assert s.network_interfaces == ("eth0", "eth1", "ib0")
    # horovodrun's --tcp sets NCCL_IB_DISABLE=1 for the workers in every mode.
    assert s.env_overrides["NCCL_IB_DISABLE"] == "1"
    for argv in (("--gloo", "--tcp"), ("--mpi", "--tcp")):
        assert cli.settings_from_args(parse("-np", "1", *argv)).env_overrides[
            "NCCL_IB_DISABLE"] == "1"
    assert "NCCL_IB_DISABLE" not in cli.settings_from_args(parse("-np", "1", "--gloo")
                                                           ).env_overrides
    with pytest.raises(ValueError, match="available slots"):
        cli.settings_from_args(parse("-np", "5", "-H", "a:2"))


def test_network_interface_takes_a_comma_list():
    # horovodrun's --network-interface "eth0,eth1" (and horovod.run's network_interface=
    # "eth0,eth1") is a comma list; it used to be taken as one interface named 'eth0,eth1'.
    s = cli.settings_from_args(parse("-np", "1", "--tcp", "--network-interface", "eth0, eth1",
                                     "--network-interface", "ib0", "--network-interface", "eth0"))
    assert s.network_interfaces == ("eth0", "eth1", "ib0")


@pytest.mark.parametrize("kwargs", [{"network_interface": "lo,eth0"},
                                    {"network_interface": ["lo", "eth0"]},
                                    {"network_interface": "lo", "network_interfaces": ["eth0"]}])
def test_horovod_run_network_interface_comma_list(monkeypatch, kwargs):
    from launcher import api
    seen = {}
    monkeypatch.setattr(api, "_run_tcp", lambda settings, blob: seen.setdefault("s", settings))
    with pytest.warns(DeprecationWarning, match="use network_interfaces instead"):
        api.run(print, num_proc=1, use_gloo=True, **kwargs)
    assert seen["s"].network_interfaces == ("lo", "eth0")


def test_horovod_run_mpi_args_in_tcp_mode_warns(monkeypatch):
    # hvdrun warns about --mpi-args in tcp mode; horovod.run dropped mpi_args without a word.
    from launcher import api
    monkeypatch.setattr(api, "_run_tcp", lambda settings, blob: [None])
    with pytest.warns(RuntimeWarning, match=r"mpi_args=\.\.\.\) has no effect: this run is in "
                                             r"tcp mode \(use_gloo=True\)"):
        api.run(print, num_proc=1, use_gloo=True, mpi_args="--mca btl tcp,self")


def test_horovod_run_mpi_args_in_an_elastic_run_warns_without_use_mpi_advice(monkeypatch):
    # use_mpi=True is refused with elastic, so the warning must not suggest it.
    from launcher import api
    monkeypatch.setattr(api, "_run_elastic", lambda *a, **k: [None])
    with pytest.warns(RuntimeWarning) as got:
        api.run(print, num_proc=1, min_num_proc=1, host_discovery_script="./d.sh",
                mpi_args="--mca btl tcp,self")
    text = " ".join(str(w.message) for w in got)
    assert "elastic runs always are" in text and "use_mpi" not in text


def test_jsrun_is_refused_by_name(capsys):
    # horovodrun's --jsrun: argparse said only "unrecognized arguments: --jsrun".
    with pytest.raises(SystemExit):
        parse("-np", "1", "--jsrun")
    assert "--jsrun: ringvod has no jsrun (IBM LSF) launch; use --mpi" in capsys.readouterr().err


def test_mutually_exclusive_groups():
    for argv in (["--gloo", "--mpi"], ["-H", "a:1", "--hostfile", "f"]):
        with pytest.raises(SystemExit):
            parse("-np", "1", *argv)


def test_command_remainder_keeps_its_flags():
    a = cli.build_parser().parse_args(["-np", "2", "python", "train.py", "--lr", "0.1", "-v"])
    assert a.command == ["python", "train.py", "--lr", "0.1", "-v"]
    assert a.version is False


# --- config file ---------------------------------------------------------------------------

YAML = """\
controller: gloo
params:
  fusion_threshold_mb: 8
  cycle_time_ms: 3
  cache_capacity: 16
  hierarchical_allreduce: true
  hierarchical_allgather: false
  torus_allreduce: false
autotune:
  enabled: true
  log_file: /tmp/at.csv
  warmup_samples: 2
  steps_per_sample: 4
  bayes_opt_max_samples: 6
  gaussian_process_noise: 0.5
timeline:
  filename: /tmp/tl.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 11
  shutdown_time_seconds: 22
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: "0,1"
  gloo_timeout_seconds: 45
logging:
  level: debug
  with_timestamp: false
"""


def test_config_file_sets_every_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(YAML)
    args = parse("-np", "1", "--config-file", str(f))
    env = cli.env_from_args(args)
    assert env == {
        "HOROVOD_FUSION_THRESHOLD": str(8 << 20), "HOROVOD_CYCLE_TIME": "3.0",
        "HOROVOD_CACHE_CAPACITY": "16", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_TORUS_ALLREDUCE": "0",
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
        "HOROVOD_TIMELINE": "/tmp/tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "11",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "22", "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "0,1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_LOG_HIDE_TIME": "1"}
    assert cli.settings_from_args(args).mode == "tcp"


def test_command_line_flags_win_over_the_config_file_wherever_they_stand(tmp_path):
    # horovodrun (test_run.py's test_config_file_override_args): a flag given on the command
    # line, before or after --config-file, is never overridden by the file.
    f = tmp_path / "c.yaml"
    f.write_text("params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 3\n  cache_capacity: 5\n"
                 "autotune:\n  enabled: true\n"
                 "stall_check:\n  enabled: true\n"
                 "logging:\n  level: error\n  with_timestamp: true\n")
    env = env_of("--fusion-threshold-mb", "1", "--no-autotune", "--no-stall-check",
                 "--log-without-timestamp", "--config-file", str(f), "--cycle-time-ms", "7")
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(1 << 20)  # flag before the file
    assert env["HOROVOD_CYCLE_TIME"] == "7.0"  # flag after the file
    assert env["HOROVOD_CACHE_CAPACITY"] == "5"  # not on the command line: from the file
    assert env["HOROVOD_AUTOTUNE"] == "0"  # --no-autotune beats enabled: true
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"  # --no-stall-check beats enabled: true
    assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert env["HOROVOD_LOG_LEVEL"] == "ERROR"


@pytest.mark.parametrize("flag,var,value", [
    ("--stall-check", "HOROVOD_STALL_CHECK_DISABLE", "0"),
    ("--no-mpi-threads-disable", "HOROVOD_MPI_THREADS_DISABLE", "0"),
    ("--log-with-timestamp", "HOROVOD_LOG_HIDE_TIME", "0"),
    ("--log-hide-timestamp", "HOROVOD_LOG_HIDE_TIME", "1"),
    ("--no-log-hide-timestamp", "HOROVOD_LOG_HIDE_TIME", "0"),
])
def test_horovodrun_hidden_flag_spellings(tmp_path, flag, var, value):
    # horovodrun accepts these (hidden from --help); a script using them must not fail with
    # "unrecognized arguments" (or, for --stall-check, "ambiguous option"), and the flag beats
    # the config file as the visible ones do.
    assert env_of(flag)[var] == value
    f = tmp_path / "c.yaml"
    f.write_text("stall_check:\n  enabled: false\nlibrary_options:\n  mpi_threads_disable: "
                 f"true\nlogging:\n  with_timestamp: {'true' if value == '1' else 'false'}\n")
    assert env_of(flag, "--config-file", str(f))[var] == value
    action = next(a for a in cli.build_parser()._actions if flag in a.option_strings)
    assert action.help == argparse.SUPPRESS


def test_config_file_settable_flags_default_to_none():
    # _given_on_command_line reads "not None" as "given": every dest the file sets must
    # default to None.
    args = cli.build_parser().parse_args(["-np", "1", "x"])
    for section in cli.YAML_KEYS.values():
        for dest in section.values():
            assert getattr(args, dest.lstrip("!")) is None, dest
    assert args.use_gloo is None and args.use_mpi is None


@pytest.mark.parametrize("controller,flag,mode", [("mpi", "--gloo", "tcp"),
                                                  ("gloo", "--mpi", "mpi"),
                                                  ("mpi", "--tcp", "tcp")])
@pytest.mark.parametrize("flag_first", [True, False])
def test_controller_flag_wins_over_config_file(tmp_path, controller, flag, mode, flag_first):
    f = tmp_path / "c.yaml"
    f.write_text(f"controller: {controller}\n")
    argv = [flag, "--config-file", str(f)] if flag_first else ["--config-file", str(f), flag]
    assert cli._mode(parse("-np", "1", *argv)) == mode
    assert cli._mode(parse("-np", "1", "--config-file", str(f))) != mode  # file alone


def test_yaml_table_names_real_dests():
    dests = {a.dest for a in cli.build_parser()._actions}
    for section in cli.YAML_KEYS.values():
        for dest in section.values():
            assert dest.lstrip("!") in dests


@pytest.mark.parametrize("text,match", [("params:\n  fusion_mb: 1\n", "unknown key params.fusion_mb"),
                                        ("nope: {}\n", "unknown section 'nope'"),
                                        ("controller: jsrun\n", "controller"),
                                        ("params:\n  cache_capacity: lots\n", "cache_capacity"),
                                        ("timeline:\n  mark_cycles: maybe\n",
                                         "timeline.mark_cycles='maybe': cannot parse boolean"),
                                        ("logging:\n  level: verbose\n",
                                         "logging.level='verbose': not a log level; use one of "
                                         "TRACE, DEBUG"),
                                        ("library_options:\n  thread_affinity: a,b\n",
                                         "library_options.thread_affinity='a,b': 'a,b' is not a "
                                         "comma list of core ids")])
def test_config_file_errors(tmp_path, capsys, text, match):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit):
        parse("-np", "1", "--config-file", str(f))
    assert match in capsys.readouterr().err


def test_bad_thread_affinity_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse("-np", "1", "--thread-affinity", "a,b")
    assert "argument --thread-affinity: 'a,b' is not a comma list of core ids" in (
        capsys.readouterr().err)


# --- worker environment --------------------------------------------------------------------

SLOT = SlotInfo("hostA", rank=3, local_rank=1, cross_rank=1, size=4, local_size=2, cross_size=2)
PARENT = {"PATH": "/bin", "BASH_FUNC_foo%%": "() { :; }", "OLDPWD": "/x",
          "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0", "_HOROVOD_SECRET_KEY": "old",
          "HOROVOD_SECRET_KEY": "stale", "OMPI_COMM_WORLD_RANK": "7", "MY_VAR": "a b'c"}


def test_exportable_env():
    assert exportable_env(PARENT) == {"PATH": "/bin", "NCCL_NVLS_ENABLE": "0",
                                      "OMPI_COMM_WORLD_RANK": "7", "MY_VAR": "a b'c"}
    assert not is_exportable("MY_CUDA_VISIBLE_DEVICES")
    assert is_exportable("NCCL_SOCKET_IFNAME")


@pytest.mark.parametrize("remote", [False, True])
def test_worker_env(remote):
    env = worker_env(PARENT, SLOT, remote=remote, overrides={"HOROVOD_CYCLE_TIME": "2"},
                     rendezvous=("10.0.0.1", 1234), secret_hex="ab" * 32, oversubscribed=True)
    assert env["HOROVOD_RANK"] == "3" and env["HOROVOD_SIZE"] == "4"
    assert env["HOROVOD_LOCAL_RANK"] == "1" and env["HOROVOD_LOCAL_SIZE"] == "2"
    assert env["HOROVOD_CROSS_RANK"] == "1" and env["HOROVOD_CROSS_SIZE"] == "2"
    assert env["HOROVOD_HOSTNAME"] == "hostA"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "1234"
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["HOROVOD_SECRET_KEY"] == "ab" * 32
    assert "_HOROVOD_SECRET_KEY" not in env
    assert env["HOROVOD_CYCLE_TIME"] == "2"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["MY_VAR"] == "a b'c"
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert "OMPI_COMM_WORLD_RANK" not in env  # a foreign launcher's rank must not leak
    # Local workers keep this machine's GPU mask; remote ones must not get it.
    assert ("CUDA_VISIBLE_DEVICES" in env) is (not remote)
    assert ("BASH_FUNC_foo%%" in env) is (not remote)


def test_worker_env_not_oversubscribed_and_redact():
    env = worker_env({}, SLOT, remote=False, overrides={}, rendezvous=None, secret_hex=None,
                     oversubscribed=False)
    assert "OMPI_MCA_mpi_yield_when_idle" not in env and "HOROVOD_SECRET_KEY" not in env
    assert redact({"HOROVOD_SECRET_KEY": "x", "A": "b"}) == {"HOROVOD_SECRET_KEY": "<redacted>",
                                                            "A": "b"}


# --- ssh -----------------------------------------------------------------------------------

def test_ssh_commands():
    assert ssh_base("h", 2222, "/k") == ["ssh", "-o", "PasswordAuthentication=no", "-o",
                                         "StrictHostKeyChecking=no", "-p", "2222", "-i", "/k",
                                         "--", "h"]
    assert ssh_base("h") == ["ssh", "-o", "PasswordAuthentication=no", "-o",
                             "StrictHostKeyChecking=no", "--", "h"]
    text = remote_command(["python", "my script.py", "--x=$HOME"], "/work dir", python="/py",
                          launcher_root="/src")
    assert text.startswith("cd '/work dir' > /dev/null 2>&1 ; exec /py -c ")
    words = shlex.split(text.split(";", 1)[1])
    assert words[0] == "exec" and words[1] == "/py" and words[2] == "-c"
    assert words[4:] == ["/src", "--", "python", "my script.py", "--x=$HOME"]
    assert "Timed out waiting for ssh" in timeout_message("ssh")
    assert "--start-timeout" in timeout_message("x")


@pytest.mark.timeout(60)
def test_a_host_name_is_never_an_ssh_option(tmp_path, monkeypatch):
    """A host such as `-E<file>` must never reach ssh (or mpirun's ssh) as an option: `-E<file>`
    would make ssh append its log to that file, `-F<file>` read an ssh config (ProxyCommand)
    from it. -H, hostfiles and discovery output refuse a leading `-`, and ssh's own options
    end with `--` before the host. Runs the real ssh."""
    from launcher.elastic.discovery import DiscoveryError, parse_discovery_output
    import shutil

    from launcher import ssh

    if shutil.which("ssh") is None:
        pytest.skip("ssh is not installed")
    monkeypatch.chdir(tmp_path)
    host = "-Einjected.log"
    with pytest.raises(ValueError, match="Invalid host input"):
        parse_hosts(f"{host}:1")
    with pytest.raises(ValueError, match="cannot parse"):
        parse_hostfile_text(f"{host} slots=1\n")
    with pytest.raises(DiscoveryError, match="printed"):
        parse_discovery_output(f"{host}:1\n", None, "the discovery script")
    with pytest.raises((ssh.SSHCheckError, ssh.StartTimeoutError)):
        ssh.check_hosts([host], timeout=20)
    argv = ssh.ssh_worker_argv(host, ["true"], str(tmp_path))
    subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert not (tmp_path / "injected.log").exists(), "ssh took the host name as -E <file>"


def test_ctrl_c_during_the_ssh_check_stops_it_at_once(monkeypatch):
    """A host that never answers: Ctrl-C must not wait for --start-timeout."""
    import signal
    import time

    from launcher import ssh

    # The probe becomes `sh -c 'sleep 30' h true`: a host that never answers.
    monkeypatch.setattr(ssh, "ssh_base", lambda host, *_a, **_kw: ["sh", "-c", "sleep 30", host])

    def interrupt(_sig, _frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    start = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            ssh.check_hosts(["a", "b"], timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - start < 5


# --- mpirun --------------------------------------------------------------------------------

OMPI4 = parse_mpi_version("mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/")
OMPI5 = parse_mpi_version("mpirun (Open MPI) 5.0.11\n")
MPICH = parse_mpi_version("HYDRA build details:\n    Version:                                 4.1.2\n")
INTEL = parse_mpi_version("Intel(R) MPI Library for Linux* OS, Version 2021.9 Build 2023\n")
SPECTRUM = parse_mpi_version("mpirun (IBM Spectrum MPI) 10.4.0.0\n")
HOSTS = [HostInfo("a", 2), HostInfo("b", 2)]
ENV = {"PATH": "/bin", "HOROVOD_CYCLE_TIME": "2", "OMPI_MCA_x": "1", "HOROVOD_SECRET_KEY": "s",
       "CUDA_VISIBLE_DEVICES": "0", "BASH_FUNC_f%%": "x"}


def test_parse_mpi_version():
    assert OMPI4 == MPIImpl("openmpi", (4, 1, 5), "mpirun (Open MPI) 4.1.5")
    assert OMPI5.version == (5, 0, 11)
    assert MPICH.name == "mpich" and MPICH.version == (4, 1, 2)
    assert INTEL.name == "intel" and SPECTRUM.name == "spectrum"
    with pytest.raises(MPIUnavailableError, match="unrecognised"):
        parse_mpi_version("some other mpi 1.0")


def test_openmpi4_command():
    argv = build_mpirun_command(OMPI4, num_proc=4, hosts=HOSTS, command=["python", "t.py"],
                                env=ENV, is_root=True, ssh_port=22, ssh_identity_file="/k",
                                network_interfaces=["eth0"], output_filename="/out",
                                mpi_args="--report-bindings -v")
    assert argv == [
        "mpirun", "--allow-run-as-root", "--tag-output", "-np", "4", "-H", "a:2,b:2",
        "--bind-to", "none", "--map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib",
        "-mca", "op", "^avx", "-mca", "plm_rsh_args", "-p 22 -i /k", "-mca", "btl_tcp_if_include", "eth0",
        "--output-filename", "/out", "-x", "HOROVOD_CYCLE_TIME", "-x", "PATH",
        "--report-bindings", "-v", "python", "t.py"]


def test_openmpi5_command_not_root_oversubscribed():
    argv = build_mpirun_command(OMPI5, num_proc=3, hosts=[HostInfo("localhost", 3)],
                                command=["x"], env={"A": "1"}, is_root=False,
                                oversubscribe=True, ssh_port=2222, output_filename="/o")
    assert "--allow-run-as-root" not in argv
    assert argv[argv.index("--output-filename") + 1] == "/o/rank"
    assert "--oversubscribe" in argv
    assert ["-mca", "btl", "^openib"] != argv[argv.index("ob1") + 1:argv.index("ob1") + 4]
    assert argv[argv.index("--prtemca"):argv.index("--prtemca") + 3] == [
        "--prtemca", "plm_ssh_args", "-p 2222"]
    assert argv[-3:] == ["-x", "A", "x"]


def test_openmpi_secret_and_values_stay_off_the_command_line():
    argv = build_mpirun_command(OMPI5, num_proc=1, hosts=[HostInfo("a", 1)], command=["x"],
                                env={"HOROVOD_SECRET_KEY": "topsecret", "B": "value"})
    assert "HOROVOD_SECRET_KEY" not in argv and "topsecret" not in argv and "value" not in argv
    argv = build_mpirun_command(OMPI5, num_proc=1, hosts=[HostInfo("a", 1)], command=["x"],
                                env={"HOROVOD_SECRET_KEY": "topsecret"},
                                extra_exports=["HOROVOD_SECRET_KEY"])
    assert ["-x", "HOROVOD_SECRET_KEY"] == argv[-3:-1] and "topsecret" not in argv


def test_binding_args_override_and_spectrum():
    argv = build_mpirun_command(OMPI5, num_proc=2, hosts=HOSTS, command=["x"], env={},
                                binding_args="--bind-to core")
    assert "--bind-to" in argv and argv[argv.index("--bind-to") + 1] == "core"
    assert "slot" not in argv
    argv = build_mpirun_command(SPECTRUM, num_proc=2, hosts=HOSTS, command=["x"], env={},
                                tcp_only=True)
    assert "--tag-output" in argv and "-tcp" in argv and "socket" in argv
    assert "pml" not in argv


@pytest.mark.parametrize("impl", [MPICH, INTEL])
def test_hydra_commands(impl):
    argv = build_mpirun_command(impl, num_proc=4, hosts=HOSTS, command=["python", "t.py"],
                                env=ENV, is_root=True, ssh_port=22,
                                network_interfaces=["ib0", "eth0"])
    assert argv == ["mpirun", "-l", "-np", "4", "-hosts", "a,b", "-ppn", "2", "-bind-to", "none",
                    "-map-by", "slot", "-genvall", "-bootstrap-exec-args", "-p 22", "-iface",
                    "ib0", "python", "t.py"]
    uneven = build_mpirun_command(impl, num_proc=3, hosts=[HostInfo("a", 2), HostInfo("b", 1)],
                                  command=["x"], env={})
    assert uneven[uneven.index("-hosts") + 1] == "a:2,b:1" and "-ppn" not in uneven
    with pytest.raises(ValueError, match="output-filename"):
        build_mpirun_command(impl, num_proc=1, hosts=HOSTS, command=["x"], env={},
                             output_filename="/o")


def test_launch_settings_validation():
    with pytest.raises(ValueError, match="available slots"):
        LaunchSettings(num_proc=3, hosts=(HostInfo("a", 2),), mode="tcp", command=("x",))
    with pytest.raises(ValueError, match="mode"):
        LaunchSettings(num_proc=1, hosts=(HostInfo("a", 2),), mode="jsrun", command=("x",))
    with pytest.raises(ValueError, match="no command"):
        LaunchSettings(num_proc=1, hosts=(HostInfo("a", 2),), mode="tcp", command=())


def test_usage_errors_are_short(capsys):
    for argv, msg in ((["-np", "-1", "true"], "-np must be at least 1 (got -1)"),
                      (["-np", "0", "true"], "-np must be at least 1 (got 0)"),
                      (["-np", "2", "--bogus", "true"], "unrecognized arguments: --bogus"),
                      (["-np", "2", "no_such_command_xyz"], "cannot run 'no_such_command_xyz'")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hvdrun: error: {msg}"), err
        lines = err.splitlines()
        assert len(lines) == 2 and "hvdrun --help" in lines[1], err


def test_python_file_runs_with_this_python(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.resolve_command(["train.py", "--lr", "1"]) == [sys.executable, "train.py",
                                                               "--lr", "1"]
    assert cli.resolve_command(["python3", "train.py"]) == ["python3", "train.py"]
    with pytest.raises(ValueError, match="cannot run 'other.py': no such file in"):
        cli.resolve_command(["other.py"], [HostInfo("localhost", 2)])
    assert cli.resolve_command(["other.py"], [HostInfo("node7", 2)]) == ["other.py"]


def test_gloo_and_tcp_both_select_tcp_mode():
    assert cli.settings_from_args(parse("-np", "2", "--gloo", "true")).mode == "tcp"
    assert cli.settings_from_args(parse("-np", "2", "--tcp", "true")).mode == "tcp"
    s = cli.settings_from_args(parse("-np", "2", "--mpi", "--tcp", "true"))
    assert s.mode == "mpi" and s.tcp_only  # Horovod's meaning: MPI over TCP only


@pytest.mark.parametrize("given,env,expected", [(None, "7", 7.0), (None, None, 30.0),
                                                (3, "7", 3.0)])
def test_horovod_run_start_timeout_reads_the_environment(monkeypatch, given, env, expected):
    import launcher.launch
    from launcher import api

    seen = []

    def run_tcp(settings, **_kw):
        seen.append(settings)
        raise KeyboardInterrupt("stop before any worker starts")

    monkeypatch.setattr(launcher.launch, "run_tcp", run_tcp)
    if env is None:
        monkeypatch.delenv("HOROVOD_START_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_START_TIMEOUT", env)
    with pytest.raises(KeyboardInterrupt):
        api.run(print, num_proc=1, use_gloo=True, start_timeout=given)
    assert seen[0].start_timeout == expected


def test_bad_start_timeout_in_the_environment_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "soon")
    with pytest.raises(SystemExit):
        cli.main(["-np", "1", "--tcp", sys.executable, "-c", "pass"])
    assert "hvdrun: error: HOROVOD_START_TIMEOUT='soon' is not a valid float (s)" in (
        capsys.readouterr().err)
