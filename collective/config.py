"""The only reader of the environment: one table of options, a frozen Config read at `init()`.

Each `Option` names its environment variable (Horovod's names), type, default, unit and doc,
and optionally the `hvdrun` flag that sets it. The launcher builds its tuning flags, the README
table and `hvdrun --help` from `OPTIONS`, so the three cannot drift apart.

Precedence: keyword override > environment > default.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

__all__ = ["Option", "OPTIONS", "SHARED_OPTIONS", "Config", "read_env", "options_by_field",
           "environ_snapshot", "no_effect_set", "warn_no_effect", "update_environ", "out_of_range"]


_LEADING_INT = re.compile(r"[+-]?[0-9]+")


def _bool(text: str) -> bool:
    """Horovod's rule, as its `strtol` reads the value: the leading integer, > 0 is true,
    whatever follows ('1.0' is true, '0.5' false); plus true/false, yes/no, on/off in any case.

    Raises:
        ValueError: none of these (`read_env` turns it into a warning naming the variable).
    """
    t = text.strip().lower()
    if t in ("", "false", "no", "off"):
        return False
    if t in ("true", "yes", "on"):
        return True
    m = _LEADING_INT.match(t)
    if m is None:
        raise ValueError(f"cannot parse boolean value {text!r}; use 1/0, true/false, yes/no "
                         "or on/off")
    return int(m.group()) > 0


def _core_list(text: str) -> str:
    """HOROVOD_THREAD_AFFINITY: comma-separated core ids, kept as text ('' = no pinning).

    Raises:
        ValueError: an entry is not a core id.
    """
    cores = [c.strip() for c in text.split(",")]
    if not all(c.isascii() and c.isdigit() for c in cores):  # isdigit alone takes "²"
        raise ValueError(f"{text!r} is not a comma list of core ids (e.g. 0,1)")
    return ",".join(cores)


def _transport(text: str) -> str:
    """HOROVOD_CONTROLLER / HOROVOD_CPU_OPERATIONS: 'mpi', 'gloo' or 'tcp' in any case
    ('' = detect), as 'mpi' or 'tcp' (Horovod's Gloo is ringvod's tcp mode).

    Raises:
        ValueError: any other name (Horovod refuses them too; ringvod has no oneCCL).
    """
    t = text.strip().lower()
    if t not in ("", "mpi", "gloo", "tcp"):
        raise ValueError(f"{text!r} is not supported; use mpi, or gloo (ringvod's tcp mode)")
    return "tcp" if t == "gloo" else t


def _cpu_operations(text: str) -> str:
    """HOROVOD_CPU_OPERATIONS: as `_transport`, plus Horovod's 'ccl' (oneCCL), which ringvod
    accepts and, having no oneCCL, warns about like any value other than its mode's.

    Raises:
        ValueError: any other name.
    """
    if text.strip().lower() == "ccl":
        return "ccl"
    try:
        return _transport(text)
    except ValueError:
        raise ValueError(f"{text!r} is not supported; use mpi, gloo (ringvod's tcp mode) or "
                         "ccl (no effect in ringvod)") from None


@dataclass(frozen=True)
class Option:
    field: str  # attribute of Config
    env: str  # environment variable
    type: Callable[[str], Any]
    default: Any
    unit: str = ""
    doc: str = ""
    cli: str = ""  # hvdrun flag that sets it ("" = none)
    cli_scale: float = 1.0  # env value = flag value * scale (e.g. MB -> bytes)
    # Accepted for Horovod compatibility but read by nothing: the README table and
    # `hvdrun --help` say "(no effect in ringvod)" and `init()` warns when it is set.
    no_effect: bool = False
    # Shapes what the ranks exchange, so every rank must use the same value: `init()` gives
    # every rank rank 0's value (and warns on a rank whose own differs).
    shared: bool = False

    def __post_init__(self) -> None:
        if self.no_effect and not self.doc.endswith(NO_EFFECT):
            object.__setattr__(self, "doc", f"{self.doc} {NO_EFFECT}")
        if self.shared and not self.doc.endswith(SHARED):
            object.__setattr__(self, "doc", f"{self.doc} {SHARED}")


NO_EFFECT = "(no effect in ringvod)"
SHARED = "(every rank uses rank 0's value)"


OPTIONS: tuple[Option, ...] = (
    # --- tuning -----------------------------------------------------------------------------
    Option("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", int, 128 * 1024 * 1024, "bytes",
           "fusion buffer size; 0 disables fusion", "--fusion-threshold-mb", 1024 * 1024,
           shared=True),
    Option("cycle_time_ms", "HOROVOD_CYCLE_TIME", float, 1.0, "ms",
           "longest wait of the coordinator between cycles (it wakes at once on new work)",
           "--cycle-time-ms"),
    Option("cache_capacity", "HOROVOD_CACHE_CAPACITY", int, 1024, "entries",
           "response cache size; 0 disables the cache", "--cache-capacity", shared=True),
    Option("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", _bool, False, "",
           "hierarchical allreduce; accepted, ringvod leaves the topology to NCCL",
           "--hierarchical-allreduce", no_effect=True),
    Option("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", _bool, False, "",
           "hierarchical allgather; accepted", "--hierarchical-allgather", no_effect=True),
    Option("torus_allreduce", "HOROVOD_TORUS_ALLREDUCE", _bool, False, "",
           "torus allreduce; accepted", "--torus-allreduce", no_effect=True),
    Option("disable_group_fusion", "HOROVOD_DISABLE_GROUP_FUSION", _bool, False, "",
           "fuse grouped ops only with members of the same group", shared=True),
    Option("batch_d2d_memcopies", "HOROVOD_BATCH_D2D_MEMCOPIES", _bool, True, "",
           "pack GPU fusion buffers with one batched copy", no_effect=True),
    Option("bucket_cap_mb", "HOROVOD_BUCKET_CAP_MB", float, 25.0, "MB",
           "ringvod: DistributedOptimizer packs gradients into buckets of this size, one "
           "allreduce each (0 = one allreduce per gradient, as Horovod)", "--bucket-cap-mb",
           shared=True),
    Option("num_nccl_streams", "HOROVOD_NUM_NCCL_STREAMS", int, 1, "",
           "NCCL streams per device; ringvod uses one", "--num-nccl-streams",
           no_effect=True),
    Option("enable_async_completion", "HOROVOD_ENABLE_ASYNC_COMPLETION", _bool, False, "",
           "GPU ops complete asynchronously; ringvod's always do (CUDA events, docs/gpu.md)",
           no_effect=True),
    Option("enable_xla_ops", "HOROVOD_ENABLE_XLA_OPS", _bool, False, "",
           "TensorFlow XLA custom calls; ringvod's collectives cannot run in XLA-compiled "
           "functions (docs/tensorflow.md)", no_effect=True),
    Option("disable_nvtx_ranges", "HOROVOD_DISABLE_NVTX_RANGES", _bool, False, "",
           "turn off NVTX ranges; ringvod emits none", no_effect=True),
    Option("adasum_mpi_chunk_size", "HOROVOD_ADASUM_MPI_CHUNK_SIZE", int, 1 << 30, "bytes",
           "Adasum's MPI chunk size; ringvod has no Adasum", no_effect=True),
    Option("ccl_cache", "HOROVOD_CCL_CACHE", _bool, False, "",
           "oneCCL cache; ringvod has no oneCCL", no_effect=True),
    Option("thread_affinity", "HOROVOD_THREAD_AFFINITY", _core_list, "", "",
           "comma list of core ids for the coordinator thread, one per local rank",
           "--thread-affinity"),
    # --- autotune ---------------------------------------------------------------------------
    Option("autotune", "HOROVOD_AUTOTUNE", _bool, False, "",
           "tune the fusion threshold, cycle time, DistributedOptimizer bucket size and "
           "response cache while training runs (a knob set in the environment is held fixed)",
           "--autotune", shared=True),
    Option("autotune_log", "HOROVOD_AUTOTUNE_LOG", str, "", "path",
           "autotune CSV log written by rank 0 (Horovod's columns, then bucket_cap_mb; one row "
           "per scored setting, the best last)",
           "--autotune-log-file"),
    Option("autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", int, 3, "",
           "autotune scores discarded at the start (each the median of 5 samples)",
           "--autotune-warmup-samples"),
    Option("autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", int, 10, "",
           "steps per autotune sample", "--autotune-steps-per-sample"),
    Option("autotune_bayes_opt_max_samples", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", int, 20,
           "", "most settings autotune scores", "--autotune-bayes-opt-max-samples"),
    Option("autotune_gaussian_process_noise", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", float,
           0.8, "", "Gaussian process noise; ringvod's search uses no Gaussian process",
           "--autotune-gaussian-process-noise", no_effect=True),
    # --- timeline ---------------------------------------------------------------------------
    Option("timeline", "HOROVOD_TIMELINE", str, "", "path",
           "Chrome trace file written by rank 0, or DYNAMIC", "--timeline-filename"),
    Option("timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", _bool, False, "",
           "mark coordinator cycles in the timeline", "--timeline-mark-cycles"),
    # --- stall inspector --------------------------------------------------------------------
    Option("stall_check_disable", "HOROVOD_STALL_CHECK_DISABLE", _bool, False, "",
           "disable the stall inspector", "--no-stall-check"),
    Option("stall_check_time", "HOROVOD_STALL_CHECK_TIME_SECONDS", float, 60.0, "s",
           "warn about tensors that some ranks have not submitted for this long",
           "--stall-check-warning-time-seconds"),
    Option("stall_shutdown_time", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", float, 0.0, "s",
           "shut down when a tensor has stalled this long (0 = never)",
           "--stall-check-shutdown-time-seconds"),
    # --- logging ----------------------------------------------------------------------------
    Option("log_level", "HOROVOD_LOG_LEVEL", str, "warning", "",
           "trace, debug, info, warning, error or fatal", "--log-level"),
    Option("log_hide_time", "HOROVOD_LOG_HIDE_TIME", _bool, False, "",
           "drop timestamps from log lines", "--log-without-timestamp"),
    # --- controller and transports ----------------------------------------------------------
    Option("controller", "HOROVOD_CONTROLLER", _transport, "", "",
           "mpi or gloo/tcp (default: detect); `hvdrun` sets it to gloo for its workers in tcp "
           "mode, clears it in MPI mode, and warns when it is set in its own environment"),
    Option("cpu_operations", "HOROVOD_CPU_OPERATIONS", _cpu_operations, "", "",
           "mpi, gloo/tcp or ccl (default: same as the controller); ringvod runs host ops over "
           "the controller's transport, so a different value only warns; `hvdrun` sets it as "
           "the controller (gloo in tcp mode, cleared in MPI mode)"),
    Option("mpi_threads_disable", "HOROVOD_MPI_THREADS_DISABLE", _bool, False, "",
           "ask MPI for MPI_THREAD_SERIALIZED instead of MPI_THREAD_MULTIPLE (ringvod's "
           "coordinator thread needs SERIALIZED); mpi_threads_supported() then returns False",
           "--mpi-threads-disable"),
    Option("gloo_timeout", "HOROVOD_GLOO_TIMEOUT_SECONDS", float, 30.0, "s",
           "tcp mode: connect and operation timeout; a silent peer is declared dead after it "
           "(0 = the default, 30 s)",
           "--gloo-timeout-seconds"),
    Option("gloo_iface", "HOROVOD_GLOO_IFACE", str, "", "", "network interface for tcp mode"),
    Option("rendezvous_addr", "HOROVOD_GLOO_RENDEZVOUS_ADDR", str, "", "",
           "rendezvous server address (set by hvdrun)"),
    Option("rendezvous_port", "HOROVOD_GLOO_RENDEZVOUS_PORT", int, 0, "",
           "rendezvous server port (set by hvdrun)"),
    Option("secret_key", "HOROVOD_SECRET_KEY", str, "", "",
           "job secret (hex) for HMAC authentication (set by hvdrun; never logged)"),
    # --- topology (set by hvdrun / elastic driver) ------------------------------------------
    Option("rank", "HOROVOD_RANK", int, -1, "", "rank of this process"),
    Option("size", "HOROVOD_SIZE", int, -1, "", "number of processes"),
    Option("local_rank", "HOROVOD_LOCAL_RANK", int, -1, "", "rank on this host"),
    Option("local_size", "HOROVOD_LOCAL_SIZE", int, -1, "", "processes on this host"),
    Option("cross_rank", "HOROVOD_CROSS_RANK", int, -1, "", "index of this host"),
    Option("cross_size", "HOROVOD_CROSS_SIZE", int, -1, "", "number of hosts"),
    Option("hostname", "HOROVOD_HOSTNAME", str, "", "", "host id of this process"),
    Option("elastic", "HOROVOD_ELASTIC", _bool, False, "", "elastic mode"),
    Option("elastic_worker_id", "HOROVOD_ELASTIC_WORKER_ID", str, "", "",
           "elastic: this worker's id (set by the elastic driver)"),
    Option("dynamic_process_sets", "HOROVOD_DYNAMIC_PROCESS_SETS", _bool, False, "",
           "allow add_process_set/remove_process_set after init, as "
           "`init(process_sets=\"dynamic\")`", shared=True),
    Option("start_timeout", "HOROVOD_START_TIMEOUT", float, 30.0, "s",
           "bounds the ssh check of remote hosts (hvdrun, horovod.run); horovod.run's workers "
           "also wait this long, at least 30 s, for its store", "--start-timeout"),
    Option("elastic_timeout", "HOROVOD_ELASTIC_TIMEOUT", float, 600.0, "s",
           "elastic: wait for enough slots", "--elastic-timeout"),
    # --- torchrun / Ray Train style environment ---------------------------------------------
    Option("env_rank", "RANK", int, -1, "", "torchrun-style rank"),
    Option("env_world_size", "WORLD_SIZE", int, -1, "", "torchrun-style world size"),
    Option("env_local_rank", "LOCAL_RANK", int, -1, "", "torchrun-style local rank"),
    Option("env_local_world_size", "LOCAL_WORLD_SIZE", int, -1, "", "torchrun-style local size"),
    Option("master_addr", "MASTER_ADDR", str, "", "", "torchrun-style rendezvous host"),
    Option("master_port", "MASTER_PORT", int, 0, "", "torchrun-style rendezvous port"),
    # --- MPI launchers ----------------------------------------------------------------------
    Option("ompi_rank", "OMPI_COMM_WORLD_RANK", int, -1, "", "set by Open MPI's mpirun"),
    Option("ompi_size", "OMPI_COMM_WORLD_SIZE", int, -1, "", "set by Open MPI's mpirun"),
    Option("pmi_rank", "PMI_RANK", int, -1, "", "set by MPICH/Hydra and Slurm"),
    Option("pmi_size", "PMI_SIZE", int, -1, "", "set by MPICH/Hydra and Slurm"),
    Option("pmix_rank", "PMIX_RANK", int, -1, "", "set by PMIx launchers"),
    Option("slurm_ntasks", "SLURM_NTASKS", int, -1, "", "set by srun"),
    # --- devices ----------------------------------------------------------------------------
    Option("cuda_visible_devices", "CUDA_VISIBLE_DEVICES", str, "", "", "GPU visibility"),
)

_BY_FIELD = {o.field: o for o in OPTIONS}
SHARED_OPTIONS = tuple(o for o in OPTIONS if o.shared)


def options_by_field() -> Mapping[str, Option]:
    return dict(_BY_FIELD)


def out_of_range(option: Option, value: Any) -> str | None:
    """Why `value` is not allowed for `option` (None: it is). A float option must be finite
    (`float()` also reads 'nan' and 'inf': NaN fails every comparison, so it slipped past the
    range checks and, e.g., switched the stall inspector off unnoticed; infinite times and sizes
    crashed the coordinator, the tcp plane or DistributedOptimizer with an OverflowError). Numbers
    that hvdrun takes as flags must be >= 0, from a flag or from the environment alike; the
    Gaussian process noise lies in [0, 1]."""
    if option.type is float and not math.isfinite(value):
        return "must be a finite number"
    if not option.cli or option.type not in (int, float):
        return None
    if option.field == "autotune_gaussian_process_noise" and not 0 <= value <= 1:
        return "must be in [0, 1]"
    return "must be >= 0" if value < 0 else None


def _parse(option: Option, raw: str) -> Any:
    try:
        value = option.type(raw)
    except (TypeError, ValueError) as exc:
        if option.type is _bool:  # Horovod reads any non-number as 0: warn, don't fail
            warnings.warn(f"{option.env}: {exc}; treating it as false", RuntimeWarning,
                          stacklevel=3)
            return False
        if option.type not in (int, float):
            raise ValueError(f"{option.env}={raw!r}: {exc}: {option.doc}") from None
        raise ValueError(
            f"{option.env}={raw!r} is not a valid {option.type.__name__}"
            f"{' (' + option.unit + ')' if option.unit else ''}: {option.doc}") from None
    why = out_of_range(option, value)
    if why:
        raise ValueError(f"{option.env}={raw!r} {why}: {option.doc}")
    return value


def read_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
    """Builds a Config from the environment (read now, not at import) and keyword overrides.

    Raises:
        TypeError: an override names no option.
        ValueError: an environment value does not parse.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for o in OPTIONS:
        raw = env.get(o.env)
        values[o.field] = o.default if raw is None or raw == "" and o.type is not str else (
            _parse(o, raw))
    explicit = {o.field for o in OPTIONS if env.get(o.env)}
    for k, v in overrides.items():
        if k not in _BY_FIELD:
            raise TypeError(f"unknown config option {k!r}; known: {sorted(_BY_FIELD)}")
        values[k] = v
        explicit.add(k)
    return Config(**values, explicit=frozenset(explicit))


def environ_snapshot() -> dict[str, str]:
    """A copy of the process environment (for the launcher, which builds child environments)."""
    return dict(os.environ)


def update_environ(values: Mapping[str, str]) -> None:
    """Sets variables of this process (an elastic reset rewrites HOROVOD_RANK and the sizes, so
    that code reading them, and the next `read_env()`, see the new world)."""
    os.environ.update(values)


@dataclass(frozen=True)
class Config:
    fusion_threshold: int
    cycle_time_ms: float
    cache_capacity: int
    hierarchical_allreduce: bool
    hierarchical_allgather: bool
    torus_allreduce: bool
    disable_group_fusion: bool
    batch_d2d_memcopies: bool
    bucket_cap_mb: float
    num_nccl_streams: int
    enable_async_completion: bool
    enable_xla_ops: bool
    disable_nvtx_ranges: bool
    adasum_mpi_chunk_size: int
    ccl_cache: bool
    thread_affinity: str
    autotune: bool
    autotune_log: str
    autotune_warmup_samples: int
    autotune_steps_per_sample: int
    autotune_bayes_opt_max_samples: int
    autotune_gaussian_process_noise: float
    timeline: str
    timeline_mark_cycles: bool
    stall_check_disable: bool
    stall_check_time: float
    stall_shutdown_time: float
    log_level: str
    log_hide_time: bool
    controller: str
    cpu_operations: str
    mpi_threads_disable: bool
    gloo_timeout: float
    gloo_iface: str
    rendezvous_addr: str
    rendezvous_port: int
    secret_key: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    elastic: bool
    elastic_worker_id: str
    dynamic_process_sets: bool
    start_timeout: float
    elastic_timeout: float
    env_rank: int
    env_world_size: int
    env_local_rank: int
    env_local_world_size: int
    master_addr: str
    master_port: int
    ompi_rank: int
    ompi_size: int
    pmi_rank: int
    pmi_size: int
    pmix_rank: int
    slurm_ntasks: int
    cuda_visible_devices: str
    # The options given (a non-empty environment variable or a keyword override), whatever
    # their value: autotune holds these fixed, as Horovod does with every knob set in the
    # environment, its default value included. Not an option itself.
    explicit: frozenset = frozenset()

    def replace(self, **changes: Any) -> "Config":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in changes:
            if k not in d:
                raise TypeError(f"unknown config option {k!r}")
        d.update(changes)
        return Config(**d)

    @property
    def cycle_time(self) -> float:
        """Cycle time in seconds."""
        return max(self.cycle_time_ms, 0.0) / 1000.0

    def __repr__(self) -> str:  # never print the secret
        items = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name not in ("secret_key", "explicit"))
        items += f", explicit={sorted(self.explicit - {'secret_key'})!r}"
        return f"Config({items})"


def no_effect_set(config: Config) -> list[str]:
    """The environment variables of options without effect that differ from their default."""
    return [o.env for o in OPTIONS if o.no_effect and getattr(config, o.field) != o.default]


def warn_no_effect(config: Config, mode: str = "") -> None:
    """One RuntimeWarning naming every option without effect that is set (called by `init()`),
    and one when HOROVOD_CPU_OPERATIONS asks for other host ops than the mode `init()` chose
    (always for ccl, a single process included: ringvod has no oneCCL)."""
    names = no_effect_set(config)
    if names:
        verb = "is set but has" if len(names) == 1 else "are set but have"
        warnings.warn(f"{', '.join(names)} {verb} no effect in ringvod (accepted for Horovod "
                      "compatibility; see the README's configuration table)", RuntimeWarning,
                      stacklevel=3)
    if config.cpu_operations == "ccl" or (
            config.cpu_operations and mode in ("mpi", "tcp") and config.cpu_operations != mode):
        asked = {"tcp": "gloo/tcp"}.get(config.cpu_operations, config.cpu_operations)
        here = f" ({mode} mode here)" if mode else ""
        warnings.warn(f"HOROVOD_CPU_OPERATIONS={asked} has no effect: ringvod "
                      f"runs host operations over its controller's transport{here}",
                      RuntimeWarning, stacklevel=3)


def markdown_table() -> str:
    """The README's table of environment variables (kept in sync by a test)."""
    rows = ["| variable | default | unit | hvdrun flag | meaning |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        if o.field.startswith(("env_", "ompi_", "pmi", "slurm", "master_", "cuda_")) or (
                o.field in ("secret_key",)):
            continue
        default = "" if o.default in ("", -1) else o.default
        rows.append(f"| `{o.env}` | {default} | {o.unit} | {('`' + o.cli + '`') if o.cli else ''}"
                    f" | {o.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m collective.config  -> the README table
    print(markdown_table())
