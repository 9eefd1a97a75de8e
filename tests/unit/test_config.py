"""collective.config: env parsing, defaults, precedence, unknown keys, the secret never shown."""
from __future__ import annotations

import dataclasses
import os
import warnings

import pytest

from collective.config import OPTIONS, Config, options_by_field, read_env

pytestmark = pytest.mark.timeout(30)


def test_defaults_match_horovod():
    c = read_env({})
    assert c.fusion_threshold == 128 * 1024 * 1024
    assert c.cycle_time_ms == 1.0 and c.cycle_time == pytest.approx(0.001)
    assert c.cache_capacity == 1024
    assert c.stall_check_time == 60.0 and c.stall_shutdown_time == 0.0
    assert c.stall_check_disable is False
    assert c.log_level == "warning" and c.log_hide_time is False
    assert c.timeline == "" and c.timeline_mark_cycles is False
    assert c.autotune is False and c.autotune_warmup_samples == 3
    assert c.autotune_steps_per_sample == 10 and c.autotune_bayes_opt_max_samples == 20
    assert c.autotune_gaussian_process_noise == 0.8
    assert c.gloo_timeout == 30.0
    assert c.rank == -1 and c.size == -1
    assert c.dynamic_process_sets is False and c.disable_group_fusion is False


def test_every_option_is_a_config_field_and_has_docs():
    names = {f.name for f in dataclasses.fields(Config)} - {"explicit"}
    assert {o.field for o in OPTIONS} == names
    envs = [o.env for o in OPTIONS]
    assert len(envs) == len(set(envs)), "an environment variable is declared twice"
    for o in OPTIONS:
        assert o.doc, f"{o.env} has no doc"
    assert options_by_field()["fusion_threshold"].env == "HOROVOD_FUSION_THRESHOLD"


def test_env_parsing_per_type():
    c = read_env({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "2.5",
                  "HOROVOD_CACHE_CAPACITY": "7", "HOROVOD_STALL_CHECK_TIME_SECONDS": "0.25",
                  "HOROVOD_TIMELINE": "/tmp/t.json", "HOROVOD_RANK": "3",
                  "OMPI_COMM_WORLD_SIZE": "4"})
    assert c.fusion_threshold == 0 and c.cycle_time_ms == 2.5 and c.cycle_time == 0.0025
    assert c.cache_capacity == 7 and c.stall_check_time == 0.25
    assert c.timeline == "/tmp/t.json" and c.rank == 3 and c.ompi_size == 4


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("true", True), ("True", True),
                                      ("false", False), ("yes", True), ("no", False),
                                      ("on", True), ("off", False), ("2", True), ("", False),
                                      # Horovod's strtol: the leading integer decides
                                      ("1.0", True), ("0.5", False), (" 1", True), ("-1", False),
                                      ("+3", True), ("1e3", True), ("00", False)])
def test_boolean_parsing(raw, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_env({"HOROVOD_STALL_CHECK_DISABLE": raw}).stall_check_disable is want


def test_unparsable_boolean_warns_naming_the_variable_and_is_false():
    with pytest.warns(RuntimeWarning, match="cannot parse boolean") as rec:
        assert read_env({"HOROVOD_AUTOTUNE": "maybe"}).autotune is False
    assert len(rec) == 1
    assert str(rec[0].message).startswith("HOROVOD_AUTOTUNE: cannot parse boolean value 'maybe'")


def test_bad_number_names_the_variable():
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='lots' is not a valid int"):
        read_env({"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME"):
        read_env({"HOROVOD_CYCLE_TIME": "fast"})


def test_empty_value_means_default_for_non_strings():
    c = read_env({"HOROVOD_FUSION_THRESHOLD": "", "HOROVOD_TIMELINE": ""})
    assert c.fusion_threshold == 128 * 1024 * 1024 and c.timeline == ""


def test_precedence_override_beats_env_beats_default():
    env = {"HOROVOD_CACHE_CAPACITY": "5"}
    assert read_env(env).cache_capacity == 5
    assert read_env(env, cache_capacity=9).cache_capacity == 9
    assert read_env({}, cache_capacity=9).cache_capacity == 9


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError, match="unknown config option 'fusion_treshold'"):
        read_env({}, fusion_treshold=1)
    with pytest.raises(TypeError, match="unknown config option"):
        read_env({}).replace(nope=1)


def test_replace_and_frozen():
    c = read_env({})
    d = c.replace(cycle_time_ms=5.0)
    assert d.cycle_time_ms == 5.0 and c.cycle_time_ms == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cycle_time_ms = 3.0  # type: ignore[misc]


@pytest.mark.parametrize("env,raw", [
    ("HOROVOD_CYCLE_TIME", "-1"), ("HOROVOD_FUSION_THRESHOLD", "-5"),
    ("HOROVOD_CACHE_CAPACITY", "-1"), ("HOROVOD_BUCKET_CAP_MB", "-1"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-60"), ("HOROVOD_START_TIMEOUT", "-1")])
def test_negative_values_are_refused_naming_the_variable(env, raw):
    # As hvdrun refuses the same values as flags (they used to be taken as they were).
    with pytest.raises(ValueError, match=rf"^{env}='{raw}' must be >= 0: "):
        read_env({env: raw})


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity"])
@pytest.mark.parametrize("env", [o.env for o in OPTIONS if o.type is float])
def test_non_finite_floats_are_refused_naming_the_variable(env, raw):
    # float() reads these; they used to pass: NaN fails every range check (a NaN stall time
    # switched the inspector off unnoticed), and an infinite cycle time, tcp timeout or bucket
    # size crashed the coordinator, the tcp plane or DistributedOptimizer with OverflowError.
    with pytest.raises(ValueError, match=rf"^{env}='{raw}' must be a finite number: "):
        read_env({env: raw})


def test_range_rules_leave_zero_and_launcher_identities_alone():
    c = read_env({"HOROVOD_CYCLE_TIME": "0", "HOROVOD_FUSION_THRESHOLD": "0",
                  "HOROVOD_RANK": "-1", "OMPI_COMM_WORLD_RANK": "-1"})
    assert c.cycle_time == 0.0 and c.fusion_threshold == 0 and c.rank == -1
    with pytest.raises(ValueError, match=r"GAUSSIAN_PROCESS_NOISE='1.5' must be in \[0, 1\]"):
        read_env({"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "1.5"})


def test_secret_is_not_in_repr_or_str():
    secret = "deadbeef" * 8
    c = read_env({"HOROVOD_SECRET_KEY": secret})
    assert c.secret_key == secret
    assert secret not in repr(c) and secret not in str(c) and "secret_key" not in repr(c)
    assert "fusion_threshold=" in repr(c)


def test_environment_is_read_at_call_time_not_import(monkeypatch):
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "17")
    assert read_env().cache_capacity == 17
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "18")
    assert read_env().cache_capacity == 18


def test_only_config_reads_the_environment():
    """collective/ modules other than config.py never touch os.environ / os.getenv."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "collective")
    offenders = []
    for dirpath, _, files in os.walk(root):
        for fn in files:
            if not fn.endswith(".py") or fn == "config.py":
                continue
            path = os.path.join(dirpath, fn)
            with open(path) as f:
                text = f.read()
            if "os.environ" in text or "os.getenv" in text or "getenv(" in text:
                offenders.append(os.path.relpath(path, root))
    assert not offenders, f"modules reading the environment besides config.py: {offenders}"


NO_EFFECT_ENVS = {"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_NUM_NCCL_STREAMS",
                  "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_HIERARCHICAL_ALLREDUCE",
                  "HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_TORUS_ALLREDUCE",
                  "HOROVOD_ENABLE_ASYNC_COMPLETION", "HOROVOD_ENABLE_XLA_OPS",
                  "HOROVOD_DISABLE_NVTX_RANGES", "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
                  "HOROVOD_CCL_CACHE"}

# Horovod's runtime variables (the compatibility contract's table, Spark's aside): each is an
# option, so it is either honoured or warns at init() that it has no effect.
HOROVOD_RUNTIME_ENVS = (
    "HOROVOD_FUSION_THRESHOLD HOROVOD_CYCLE_TIME HOROVOD_CACHE_CAPACITY "
    "HOROVOD_HIERARCHICAL_ALLREDUCE HOROVOD_HIERARCHICAL_ALLGATHER HOROVOD_TORUS_ALLREDUCE "
    "HOROVOD_AUTOTUNE HOROVOD_AUTOTUNE_LOG HOROVOD_AUTOTUNE_WARMUP_SAMPLES "
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES "
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE HOROVOD_TIMELINE HOROVOD_TIMELINE_MARK_CYCLES "
    "HOROVOD_STALL_CHECK_DISABLE HOROVOD_STALL_CHECK_TIME_SECONDS "
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS HOROVOD_LOG_LEVEL HOROVOD_LOG_HIDE_TIME "
    "HOROVOD_CONTROLLER HOROVOD_CPU_OPERATIONS HOROVOD_MPI_THREADS_DISABLE "
    "HOROVOD_GLOO_TIMEOUT_SECONDS HOROVOD_GLOO_IFACE HOROVOD_GLOO_RENDEZVOUS_ADDR "
    "HOROVOD_GLOO_RENDEZVOUS_PORT HOROVOD_RANK HOROVOD_SIZE HOROVOD_LOCAL_RANK "
    "HOROVOD_LOCAL_SIZE HOROVOD_CROSS_RANK HOROVOD_CROSS_SIZE HOROVOD_HOSTNAME HOROVOD_ELASTIC "
    "HOROVOD_DYNAMIC_PROCESS_SETS HOROVOD_THREAD_AFFINITY HOROVOD_NUM_NCCL_STREAMS "
    "HOROVOD_BATCH_D2D_MEMCOPIES HOROVOD_DISABLE_GROUP_FUSION HOROVOD_ENABLE_ASYNC_COMPLETION "
    "HOROVOD_ENABLE_XLA_OPS HOROVOD_DISABLE_NVTX_RANGES HOROVOD_ADASUM_MPI_CHUNK_SIZE "
    "HOROVOD_CCL_CACHE HOROVOD_START_TIMEOUT HOROVOD_ELASTIC_TIMEOUT").split()


def test_every_horovod_runtime_variable_is_an_option():
    envs = {o.env for o in OPTIONS}
    assert [e for e in HOROVOD_RUNTIME_ENVS if e not in envs] == []


def test_options_without_effect_say_so_in_table_and_help():
    from collective.config import NO_EFFECT, markdown_table
    from launcher.cli import build_parser
    assert {o.env for o in OPTIONS if o.no_effect} == NO_EFFECT_ENVS
    table = markdown_table()
    help_text = " ".join(build_parser().format_help().split())
    for o in OPTIONS:
        row = next((ln for ln in table.splitlines() if f"`{o.env}`" in ln), "")
        assert (NO_EFFECT in row) == o.no_effect, o.env
        if o.cli:
            assert (f"{o.doc} (env {o.env}" in help_text) and (NO_EFFECT in o.doc) == o.no_effect


def test_one_warning_names_every_option_without_effect_that_is_set():
    from collective.config import no_effect_set, warn_no_effect
    assert no_effect_set(read_env({})) == []
    # Set to its default: nothing to warn about.
    assert no_effect_set(read_env({"HOROVOD_BATCH_D2D_MEMCOPIES": "1"})) == []
    c = read_env({"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5", "HOROVOD_NUM_NCCL_STREAMS": "2",
                  "HOROVOD_BATCH_D2D_MEMCOPIES": "0", "HOROVOD_TORUS_ALLREDUCE": "1",
                  "HOROVOD_ENABLE_XLA_OPS": "1", "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "1024",
                  "HOROVOD_CYCLE_TIME": "5"})
    assert set(no_effect_set(c)) == {"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                     "HOROVOD_NUM_NCCL_STREAMS",
                                     "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_TORUS_ALLREDUCE",
                                     "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_ADASUM_MPI_CHUNK_SIZE"}
    with pytest.warns(RuntimeWarning, match="no effect in ringvod") as rec:
        warn_no_effect(c)
    assert len(rec) == 1 and "HOROVOD_NUM_NCCL_STREAMS" in str(rec[0].message)
    assert "HOROVOD_CYCLE_TIME" not in str(rec[0].message)


def test_thread_affinity_is_a_list_of_core_ids():
    assert read_env({"HOROVOD_THREAD_AFFINITY": "0, 3"}).thread_affinity == "0,3"
    assert read_env({"HOROVOD_THREAD_AFFINITY": ""}).thread_affinity == ""
    for bad in ("a,b", "0,,1", "-1", "1.5", "\u00b2"):
        with pytest.raises(ValueError, match=r"HOROVOD_THREAD_AFFINITY=.* is not a comma list "
                                             r"of core ids"):
            read_env({"HOROVOD_THREAD_AFFINITY": bad})


@pytest.mark.parametrize("raw,want", [("gloo", "tcp"), ("GLOO", "tcp"), ("tcp", "tcp"),
                                      ("MPI", "mpi"), (" mpi ", "mpi"), ("", "")])
def test_controller_names(raw, want):
    c = read_env({"HOROVOD_CONTROLLER": raw, "HOROVOD_CPU_OPERATIONS": raw})
    assert c.controller == want and c.cpu_operations == want


@pytest.mark.parametrize("env", ["HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"])
@pytest.mark.parametrize("raw", ["foo", "ccl", "nccl"])
def test_unknown_controller_is_an_error_naming_the_variable(env, raw):
    if env == "HOROVOD_CPU_OPERATIONS" and raw == "ccl":  # Horovod's oneCCL: accepted, warned
        return
    with pytest.raises(ValueError, match=f"{env}='{raw}': '{raw}' is not supported; use mpi, "
                                         r"(or )?gloo \(ringvod's tcp mode\)"):
        read_env({env: raw})


def test_cpu_operations_ccl_is_accepted_and_has_no_effect():
    # Horovod accepts CCL for host ops (oneCCL); ringvod has none: it warns, the mode stays.
    from collective.config import warn_no_effect
    from collective.runtime import detect_mode
    c = read_env({**MPI_JOB, "HOROVOD_CPU_OPERATIONS": "CCL"})
    assert c.cpu_operations == "ccl" and detect_mode(c) == "mpi"
    with pytest.warns(RuntimeWarning, match="HOROVOD_CPU_OPERATIONS=ccl has no effect"):
        warn_no_effect(c, "mpi")
    # A single process warns too (it was silent there: only mpi and tcp mode were checked).
    c = read_env({"HOROVOD_CPU_OPERATIONS": "ccl"})
    assert detect_mode(c) == "single"
    with pytest.warns(RuntimeWarning, match=r"HOROVOD_CPU_OPERATIONS=ccl has no effect: .*"
                                            r"\(single mode here\)"):
        warn_no_effect(c, "single")


MPI_JOB = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}


def test_controller_gloo_in_an_mpi_job_without_rendezvous_is_an_error():
    from collective.runtime import detect_mode
    with pytest.raises(ValueError, match="HOROVOD_CONTROLLER=gloo/tcp in an MPI job"):
        detect_mode(read_env({**MPI_JOB, "HOROVOD_CONTROLLER": "gloo"}))
    # With hvdrun's rendezvous (or alone) the controller picks tcp mode as before.
    assert detect_mode(read_env({**MPI_JOB, "HOROVOD_CONTROLLER": "gloo",
                                 "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"})) == "tcp"
    assert detect_mode(read_env({"HOROVOD_CONTROLLER": "gloo"})) == "tcp"


def test_an_mpi_communicator_in_a_tcp_launch_is_ignored_with_a_warning():
    # hvd.init(comm=MPI.COMM_WORLD) under hvdrun --tcp: over MPI every rank (no mpirun) was
    # a world of size 1, training unsynchronised; the launcher's world is the job's (Horovod's
    # Gloo controller ignores the communicator too).
    from collective.runtime import detect_mode
    comm = object()  # stands for an mpi4py communicator: anything but a list of ranks
    tcp_launch = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                  "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}
    for env in (tcp_launch, {"HOROVOD_CONTROLLER": "gloo"},
                {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"}):
        with pytest.warns(RuntimeWarning, match=r"hvd.init\(comm=<mpi4py communicator>\) has "
                                                "no effect in tcp mode"):
            assert detect_mode(read_env(env), comm) == "tcp"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert detect_mode(read_env({}), comm) == "mpi"
        assert detect_mode(read_env(MPI_JOB), comm) == "mpi"
        assert detect_mode(read_env({**MPI_JOB, "HOROVOD_CPU_OPERATIONS": "gloo"}), comm) == "mpi"
        assert detect_mode(read_env(tcp_launch), [0, 1]) == "tcp"


def test_cpu_operations_alone_does_not_split_an_mpi_job():
    from collective.config import warn_no_effect
    from collective.runtime import detect_mode
    c = read_env({**MPI_JOB, "HOROVOD_CPU_OPERATIONS": "gloo"})
    assert detect_mode(c) == "mpi"
    with pytest.warns(RuntimeWarning, match="HOROVOD_CPU_OPERATIONS=gloo/tcp has no effect: "
                                            r"ringvod runs host operations over its "
                                            r"controller's transport \(mpi mode here\)"):
        warn_no_effect(c, "mpi")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_no_effect(read_env({"HOROVOD_CPU_OPERATIONS": "gloo"}), "tcp")
        warn_no_effect(read_env({"HOROVOD_CPU_OPERATIONS": "mpi"}), "mpi")
