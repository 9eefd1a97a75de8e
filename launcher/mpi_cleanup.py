"""Removes what Open MPI leaves behind when its job is killed (SIGKILL, OOM, a lost node):
shared-memory segments (`/dev/shm/sm_segment.<host>.<uid>.<jobid>.<n>`, Open MPI 4's
`vader_segment.*`) and session directories (`/tmp/ompi.<mpirun pid>`, Open MPI 5's
`/tmp/ompi.<host>.<uid>/jf.<n>/<jobid>`; older `/tmp/prte.*`/`ompi.*` trees likewise).

Only this user's files are touched, and only when nothing alive uses them:

* a session directory named after a pid, when that pid is gone;
* a segment that no live process maps or holds open (read from /proc), older than a minute
  when cleaning up at the start of a launch (a job starting at that moment creates and maps its
  segment at once);
* a job directory `jf.<n>/<jobid>` only together with that job's segments (the jobid is the
  segment's hexadecimal field), so the session of a live job is never removed.

`hvdrun` runs mpirun as its child: it calls `clean_stale()` before it starts mpirun, and
`clean_after()` once mpirun has ended (however it ended); each says what it removed on stderr.
A SIGKILLed hvdrun cannot clean up: its job's leftovers go at the next start.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import sys
import time

__all__ = ["clean_stale", "clean_after", "candidates", "report"]

STALE_AGE = 60.0  # seconds: an unused segment this old is not one being set up right now


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its parent, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _in_use(prefixes: tuple[str, ...]) -> set[str]:
    """Paths under `prefixes` that a live process maps or holds open."""
    used: set[str] = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{proc}/maps") as f:
                for line in f:
                    i = line.find("/")
                    if i >= 0:
                        path = line[i:].rstrip("\n").removesuffix(" (deleted)")
                        if path.startswith(prefixes):
                            used.add(path)
        except OSError:
            pass
        try:
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    target = os.readlink(f"{proc}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefixes):
                    used.add(target)
        except OSError:
            pass
    return used


def _mine(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


def candidates(shm: str = "/dev/shm", tmp: str = "/tmp",
               host: str | None = None) -> dict[str, list[str]]:
    """This user's Open MPI leftovers by kind: `segments`, `pid_dirs`, `job_dirs`."""
    host = host or socket.gethostname().split(".")[0]
    uid = os.getuid()
    segs = [p for pat in (f"sm_segment.{host}.{uid}.*", f"vader_segment.{host}.*")
            for p in glob.glob(os.path.join(shm, pat))]
    pid_dirs = [p for p in glob.glob(os.path.join(tmp, "ompi.*")) + glob.glob(
        os.path.join(tmp, "prte.*")) if re.fullmatch(r"(ompi|prte)\.\d+", os.path.basename(p))]
    job_dirs = glob.glob(os.path.join(tmp, f"ompi.{host}.{uid}", "jf.*", "*"))
    return {"segments": [p for p in segs if _mine(p)],
            "pid_dirs": [p for p in pid_dirs if _mine(p)],
            "job_dirs": [p for p in job_dirs if _mine(p)]}


def _jobid(segment: str) -> str | None:
    """The decimal jobid of `sm_segment.<host>.<uid>.<hex jobid>.<n>`."""
    m = re.search(r"\.([0-9a-fA-F]+)\.\d+$", segment)
    return str(int(m.group(1), 16)) if m else None


def _select(found: dict[str, list[str]], min_age: float, only: set[str] | None,
            extra_dead_pid: int | None) -> list[str]:
    now = time.time()
    prefixes = tuple({os.path.dirname(p) + "/" for p in found["segments"]}) or ("/dev/shm/",)
    used = _in_use(prefixes) if found["segments"] else set()
    out: list[str] = []
    dead_jobs: set[str] = set()
    live_jobs: set[str] = set()
    for seg in found["segments"]:
        job = _jobid(seg)
        try:
            old = now - os.lstat(seg).st_mtime >= min_age
        except OSError:
            continue
        if seg in used or not old or (only is not None and seg not in only):
            if job:
                live_jobs.add(job)
            continue
        out.append(seg)
        if job:
            dead_jobs.add(job)
    for d in found["pid_dirs"]:
        pid = int(os.path.basename(d).split(".")[1])
        if (pid == extra_dead_pid or not _alive(pid)) and (only is None or d in only
                                                          or pid == extra_dead_pid):
            out.append(d)
    for d in found["job_dirs"]:
        job = os.path.basename(d)
        if job in dead_jobs and job not in live_jobs:
            out.append(d)
    return out


def _remove(paths: list[str]) -> list[str]:
    removed = []
    for p in paths:
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            sys.stderr.write(f"hvdrun: could not remove Open MPI leftover {p}: {exc}\n")
    return removed


def report(removed: list[str], what: str) -> None:
    """One line on stderr naming what was removed (nothing when nothing was)."""
    if not removed:
        return
    shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6
                                      else "")
    sys.stderr.write(f"hvdrun: removed {len(removed)} Open MPI leftover(s) of {what}: "
                     f"{shown}\n")
    sys.stderr.flush()


def clean_stale(shm: str = "/dev/shm", tmp: str = "/tmp", host: str | None = None,
                min_age: float = STALE_AGE, quiet: bool = False) -> list[str]:
    """Removes leftovers of finished (killed) Open MPI jobs; returns what was removed."""
    removed = _remove(_select(candidates(shm, tmp, host), min_age, None, None))
    if not quiet:
        report(removed, "jobs that are no longer running")
    return removed


def clean_after(before: dict[str, list[str]], mpirun_pid: int, shm: str = "/dev/shm",
                tmp: str = "/tmp", host: str | None = None, quiet: bool = False) -> list[str]:
    """After our mpirun (`mpirun_pid`) ended: removes what appeared since `before`
    (`candidates()` taken before it started) and nothing alive uses."""
    now = candidates(shm, tmp, host)
    seen = {p for v in before.values() for p in v}
    new = {p for v in now.values() for p in v if p not in seen}
    removed = _remove(_select(now, 0.0, new, mpirun_pid))
    if not quiet:
        report(removed, f"this job (mpirun pid {mpirun_pid})")
    return removed
