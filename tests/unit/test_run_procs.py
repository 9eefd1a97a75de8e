"""The harness's `run_procs`: exit codes as the script's own, a hard timeout that dumps every
live process's threads, and a report naming each rank."""
from __future__ import annotations

import signal

import pytest

from tests._spmd import run_procs

pytestmark = pytest.mark.timeout(60)


def test_exit_codes_per_rank_args_and_env() -> None:
    code = ("import os, sys\n"
            "print('rank', sys.argv[1], 'of', os.environ['WHO'], flush=True)\n"
            "if sys.argv[1] == '1':\n"
            "    os.kill(os.getpid(), 9)\n"
            "sys.exit(int(sys.argv[1]) * 3)\n")
    res = run_procs(3, code=code, args=["{rank}"], env=lambda r: {"WHO": f"w{r}"}, timeout=30,
                    expect_rc={1: -signal.SIGKILL, 2: 6})
    assert res.ok and res.returncodes == [0, -signal.SIGKILL, 6]
    assert res.outputs[0].strip() == "rank 0 of w0" and "rank 2 of w2" in res.outputs[2]


def test_timeout_dumps_every_live_rank_and_fails() -> None:
    code = ("import sys, time\n"
            "if sys.argv[1] == '0':\n"
            "    raise ValueError('boom')\n"
            "time.sleep(600)\n")
    res = run_procs(2, code=code, args=["{rank}"], timeout=3, check=False)
    assert res.timed_out and not res.ok and res.returncodes == [1, -signal.SIGKILL]
    report = res.report()
    assert "TIMED OUT" in report and "ValueError: boom" in report
    assert "most recent call first" in res.outputs[1]  # the faulthandler dump of rank 1
    with pytest.raises(pytest.fail.Exception, match="rank 1"):
        run_procs(2, code=code, args=["{rank}"], timeout=3)


def test_script_runs_as_main(tmp_path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nassert __name__ == '__main__'\nprint(sys.argv[1:])\n")
    res = run_procs(1, script=str(script), args=["a", "b"], timeout=30)
    assert res.outputs[0].strip() == "['a', 'b']"
