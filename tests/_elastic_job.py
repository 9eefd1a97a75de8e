"""Shared by the elastic tests (tests/integration/test_elastic.py, tests/gpu/test_elastic_gpu.py):
`Job` runs `hvdrun ... python tests/_elastic_worker.py` with a hard timeout; when it fires,
every worker still alive dumps its Python stacks (faulthandler, SIGABRT) into the output, which
the failure prints."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("_elastic_worker.py"))


class Job:
    def __init__(self, out: Path, args: list[str], env: dict[str, str], timeout: float) -> None:
        self.out, self.timeout = out, timeout
        full = dict(os.environ, ET_OUT=str(out), PYTHONFAULTHANDLER="1",
                    PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    **env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", *args, sys.executable, WORKER], cwd=REPO,
            env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.deadline = time.monotonic() + timeout

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.out.glob("pid.*") if p.read_text().strip()]

    def _dump_and_kill(self) -> str:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.communicate()[0]

    def wait_progress(self, step: int) -> None:
        """Waits until some worker has finished `step` steps."""
        while time.monotonic() < self.deadline:
            for p in self.out.glob("progress.*"):
                if any(s >= step for s in _steps(p.read_text())):
                    return
            if self.proc.poll() is not None:
                pytest.fail("hvdrun ended early:\n" + self.proc.communicate()[0])
            time.sleep(0.05)
        pytest.fail(f"no worker reached step {step}:\n{self._dump_and_kill()}")

    def finish(self) -> tuple[int, str]:
        try:
            out = self.proc.communicate(timeout=max(self.deadline - time.monotonic(), 1))[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"hvdrun did not finish within {self.timeout} s:\n"
                        f"{self._dump_and_kill()}")
        return self.proc.returncode, out

    def results(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("result.*.json"))]


def no_orphans(job: Job) -> None:
    time.sleep(0.2)
    alive = []
    for pid in job.pids():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:  # a zombie that is someone else's business is not an orphan
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                continue
        except OSError:
            continue
        alive.append(pid)
    assert not alive, f"workers still running after hvdrun exited: {alive}"


def progress_steps(job: Job) -> dict[str, list[int]]:
    return {p.name: _steps(p.read_text()) for p in job.out.glob("progress.*")}


def _steps(text: str) -> list[int]:
    """The step numbers of complete progress lines (a line being written is skipped)."""
    out = []
    for line in text.split("\n"):
        parts = line.split()
        if len(parts) == 4 and parts[3].isdigit():
            out.append(int(parts[3]))
    return out
