"""Elastic training end to end: `hvdrun --min-np ...` with real worker processes on this machine.

"Hosts" are names of this machine (localhost, 127.0.0.1, its hostname), which hvdrun runs
locally, so a test can fail, add and remove hosts. The worker is `tests/_elastic_worker.py`: a toy
training loop whose final weights are known exactly. Every test has a hard timeout; when it
fires, every worker still alive dumps its Python stacks (faulthandler, SIGABRT) into the output,
which is printed.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._elastic_job import REPO, Job, no_orphans, progress_steps

HOSTNAME = socket.gethostname()


def _expected_w(steps: int) -> float:
    return -0.5 * sum(float(s % 7 - 3) for s in range(steps))


def test_sigkill_rolls_back_to_last_commit(tmp_path: Path) -> None:
    """Test 1: a worker is SIGKILLed between commits; the others restore, re-form and finish
    with the exact weights and every step committed exactly once."""
    steps = 24
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "3", "ET_KILL": "127.0.0.1:7"}, 60)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1], out
    for r in res:
        assert r["size"] == 2 and r["step"] == steps
        assert r["log"] == list(range(steps)), r["log"]
        assert r["w"] == [_expected_w(steps)] * 4, r["w"]
        assert r["sizes"][:6] == [3] * 6 and set(r["sizes"][6:]) == {2}, r["sizes"]
    # Step 7 was reached (the kill), so steps 6 and 7 ran twice on the survivors: a rollback.
    redone = [s for s in progress_steps(job)["progress.0"] if s == 7]
    assert len(redone) == 2, progress_steps(job)
    assert "blacklisting host 127.0.0.1" in out and "exited with status code 137" in out
    assert "elastic job finished" in out and "1 reset(s)" in out
    no_orphans(job)


def test_worker_slower_to_start_than_the_gloo_timeout_at_start(tmp_path: Path) -> None:
    """At start, one worker takes longer to reach init() than HOROVOD_GLOO_TIMEOUT_SECONDS
    (a slower host): every worker is answered once all have asked, so the others' first
    rendezvous does not give up on it (which failed every worker, and the job)."""
    steps = 12
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
              {"ET_STEPS": str(steps), "ET_SLOW_START": "1:8",
               "HOROVOD_GLOO_TIMEOUT_SECONDS": "4"}, 60)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [(r["rank"], r["size"], r["step"]) for r in res] == [(0, 2, steps), (1, 2, steps)]
    assert "0 failed" in out and "0 reset(s)" in out, out
    no_orphans(job)


def test_worker_failing_before_init_at_start_is_left_out(tmp_path: Path) -> None:
    """At start the worker of one host exits before init() (a broken host): the others
    start without it (the job went down with it: their first rendezvous waited for it in
    vain and failed), and --min-np 1 is kept."""
    steps = 12
    job = Job(tmp_path, ["-np", "3", "--min-np", "1", "-H", "localhost:2,127.0.0.1:1"],
              {"ET_STEPS": str(steps), "ET_FAIL_START": "127.0.0.1"}, 60)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [(r["rank"], r["size"], r["step"]) for r in res] == [(0, 2, steps), (1, 2, steps)]
    assert "blacklisting host 127.0.0.1" in out and "0 reset(s)" in out, out
    no_orphans(job)


def test_new_worker_slower_to_start_than_the_gloo_timeout(tmp_path: Path) -> None:
    """A host appears; its worker takes longer to reach init() than
    HOROVOD_GLOO_TIMEOUT_SECONDS (slow imports, CUDA or data set-up). The survivors are
    answered once it has asked, so nobody's rendezvous gives up on it: it joins, no host is
    blacklisted, and the job finishes at the larger size."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    steps = 80
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3",
                         "--host-discovery-script", f"cat {hosts}"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "2", "ET_SLEEP": "0.1",
               "ET_SLOW_START": "2:8", "HOROVOD_GLOO_TIMEOUT_SECONDS": "4"}, 90)
    job.wait_progress(4)
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1, 2], out
    for r in res:
        assert r["size"] == 3 and r["step"] == steps and r["log"] == list(range(steps))
        assert r["w"] == [_expected_w(steps)] * 4
    assert "blacklisting" not in out and "0 failed" in out, out
    no_orphans(job)


@pytest.mark.parametrize("process_sets", ["", "dynamic"], ids=["static-sets", "dynamic-sets"])
def test_host_added_by_discovery(tmp_path: Path, process_sets: str) -> None:
    """Test 2: a host appears in the discovery output; the new worker gets the state and the
    job finishes at the larger size. With `init(process_sets="dynamic")`, the survivors'
    re-init (no argument) keeps dynamic process sets on and agrees with the new worker's."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    steps = 60
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3",
                         "--host-discovery-script", f"cat {hosts}"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "2", "ET_SLEEP": "0.1",
               "ET_PROCESS_SETS": process_sets}, 90)
    job.wait_progress(4)
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1, 2], out
    assert {r["host"] for r in res} == {"localhost", "127.0.0.1"}
    for r in res:
        assert r["size"] == 3 and r["step"] == steps
        assert r["log"] == list(range(steps))
        assert r["w"] == [_expected_w(steps)] * 4
        assert r["sizes"][0] == 2 and r["sizes"][-1] == 3
        assert r["dynamic_sets"] is (process_sets == "dynamic")
    assert "hosts added" in out and "1 new" in out, out
    # No failure: nothing was rolled back or redone.
    for name, seq in progress_steps(job).items():
        assert seq == sorted(set(seq)), (name, seq)
    no_orphans(job)


def _lose_a_host(tmp_path: Path, steps: int, timeout: float, **env: str):
    """A 3-worker job on two hosts (localhost:2, 127.0.0.1:1) whose discovery output drops
    127.0.0.1 after 4 steps; returns (job, exit code, output) once it finished."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--host-discovery-script",
                         f"cat {hosts}"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "2", "ET_SLEEP": "0.08", **env}, timeout)
    job.wait_progress(4)
    hosts.write_text("localhost:2\n")
    return (job, *job.finish())


def test_host_removed_interrupts_without_rollback(tmp_path: Path) -> None:
    """Test 3: a host disappears from the discovery output: HostsUpdatedInterrupt, the worker
    there leaves cleanly, no committed work is rolled back."""
    steps = 50
    job, code, out = _lose_a_host(tmp_path, steps, 90)
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1], out
    for r in res:
        assert r["size"] == 2 and r["log"] == list(range(steps))
        assert r["w"] == [_expected_w(steps)] * 4
    assert "hosts removed" in out and "has been removed from elastic job" in out, out
    assert "restoring the last commit" not in out and "blacklisting" not in out, out
    for name, seq in progress_steps(job).items():
        assert seq == sorted(set(seq)), (name, seq)  # nothing ran twice
    no_orphans(job)


def test_update_failing_on_one_rank_syncs_everywhere(tmp_path: Path) -> None:
    """Test 3a: a host is removed, and the broadcast of `check_host_updates()` that announces
    it fails on rank 1 only (as when a peer dies during it): rank 1 restores and syncs, rank 0
    took the interrupt for removed hosts (skip_sync). The ranks agree after the reset, so both
    sync instead of rank 0 training against rank 1's sync broadcast (a hang)."""
    steps = 40
    job, code, out = _lose_a_host(tmp_path, steps, 60, ET_UPDATE_FAILS="1")
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1], out
    for r in res:
        assert r["size"] == 2 and r["log"] == list(range(steps)), r
        assert r["w"] == [_expected_w(steps)] * 4, r["w"]
    assert "hosts removed" in out and "restoring the last commit" in out, out
    assert "the update's broadcast failed" in out, out
    no_orphans(job)


@pytest.mark.parametrize("np_args, after, what", [
    (["-np", "4"], "localhost:1\n127.0.0.1:3\n", "hosts added and removed"),
    (["-np", "3", "--max-np", "3"], "localhost:1\n127.0.0.1:2\n", "hosts removed"),
], ids=["slots-move", "removed-then-max-np-room"])
def test_round_with_new_worker_syncs_survivors(tmp_path: Path, np_args, after, what) -> None:
    """Test 3b: localhost loses a slot while 127.0.0.1 has (or gains) a free one: the worker of
    the lost slot leaves and a new one starts on 127.0.0.1. The new worker syncs the state from
    rank 0, so the survivors must sync too, even when the update said only "removed"."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.1:2\n")
    steps = 40
    job = Job(tmp_path, [*np_args, "--min-np", "2", "--host-discovery-script", f"cat {hosts}"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "2", "ET_SLEEP": "0.1",
               "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}, 40)
    job.wait_progress(4)
    hosts.write_text(after)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    size = len(res)
    assert size == int(np_args[1]), out
    for r in res:
        assert r["size"] == size and r["log"] == list(range(steps)), r
        assert r["w"] == [_expected_w(steps)] * 4, r["w"]
    assert sum(r["host"] == "127.0.0.1" for r in res) == size - 1, res
    assert what + ": now localhost:1,127.0.0.1" in out and "1 new; 1 removed" in out, out
    assert "has been removed from elastic job" in out and "restoring" not in out, out
    no_orphans(job)


def _wait_size(job: Job, size: int) -> None:
    """Waits until some worker has finished a step at world size `size`."""
    while time.monotonic() < job.deadline:
        for p in job.out.glob("progress.*"):
            if any(len(line.split()) == 4 and line.split()[2] == str(size)
                   for line in p.read_text().split("\n")[:-1]):
                return
        if job.proc.poll() is not None:
            pytest.fail("hvdrun ended early:\n" + job.proc.communicate()[0])
        time.sleep(0.05)
    pytest.fail(f"no step at size {size}:\n{job._dump_and_kill()}")


def test_new_worker_whose_first_sync_fails_is_not_rank_0(tmp_path: Path) -> None:
    """Test 3c: host localhost (found first) leaves and comes back; the new worker there joins
    the survivors (on 127.0.0.1 and this machine's name) at rank 2, and a survivor dies
    before the state sync, so the new worker's first sync fails and it restores its initial
    state. It sits on the oldest host, and the next round made it rank 0: its sync broadcast
    step 0 and zero weights, and the job silently trained again from the start. The worker
    that holds the state (127.0.0.1) is rank 0 now: nothing committed is lost."""
    hosts = tmp_path / "hosts"
    every = f"localhost:1\n127.0.0.1:1\n{HOSTNAME}:1\n"
    hosts.write_text(every)
    steps = 100
    job = Job(tmp_path, ["-np", "3", "--min-np", "1", "--max-np", "3",
                         "--host-discovery-script", f"cat {hosts}"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "2", "ET_SLEEP": "0.1",
               "ET_KILL_ON_RESET": f"3:{HOSTNAME}"}, 120)
    job.wait_progress(4)
    hosts.write_text(f"127.0.0.1:1\n{HOSTNAME}:1\n")
    _wait_size(job, 2)
    hosts.write_text(every)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [(r["rank"], r["host"]) for r in res] == [(0, "127.0.0.1"), (1, "localhost")], out
    for r in res:
        assert r["size"] == 2 and r["step"] == steps and r["log"] == list(range(steps)), r
        assert r["w"] == [_expected_w(steps)] * 4, r["w"]
        # The steps logged from the start on: at size 3, then 2 (none at 3 again: the kill).
        assert r["sizes"][0] == 3 and 2 in r["sizes"], r["sizes"]
    assert (tmp_path / f"killed_on_reset.{HOSTNAME}").exists(), out
    assert f"blacklisting host {HOSTNAME}" in out and "restoring the last commit" in out, out
    assert "has been removed from elastic job" in out and "3 reset(s)" in out, out
    no_orphans(job)


def test_new_worker_retries_a_first_init_that_fails(tmp_path: Path) -> None:
    """Test 3d: a host appears, and a survivor dies once placed in the round with the new
    worker, before the world forms: the new worker's first init() fails. It asks the driver
    for a place again, as the survivors' reset does (it exited 1 and its host was
    blacklisted), and joins the next round, below the survivor that holds the state."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    steps = 80
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "3",
                         "--host-discovery-script", f"cat {hosts}"],
              {"ET_STEPS": str(steps), "ET_COMMIT": "2", "ET_SLEEP": "0.1",
               "ET_KILL_IN_RENDEZVOUS": "3:127.0.0.1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "5"},
              120)
    job.wait_progress(4)
    hosts.write_text(f"localhost:1\n127.0.0.1:1\n{HOSTNAME}:1\n")
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [(r["rank"], r["host"]) for r in res] == [(0, "localhost"), (1, HOSTNAME)], out
    for r in res:
        assert r["size"] == 2 and r["step"] == steps and r["log"] == list(range(steps)), r
        assert r["w"] == [_expected_w(steps)] * 4, r["w"]
    assert (tmp_path / "killed_in_rendezvous.127.0.0.1").exists(), out
    assert "the first rendezvous failed" in out, out
    assert "blacklisting host 127.0.0.1" in out and f"blacklisting host {HOSTNAME}" not in out
    assert "1 failed" in out, out
    no_orphans(job)


def test_reset_limit_fails_cleanly(tmp_path: Path) -> None:
    """Test 4: failures beyond --reset-limit end the job with Horovod's message and a summary."""
    job = Job(tmp_path, ["-np", "3", "--min-np", "1", "--reset-limit", "1", "-H",
                         f"localhost:1,127.0.0.1:1,{HOSTNAME}:1"],
              {"ET_STEPS": "200", "ET_COMMIT": "2",
               "ET_KILL": f"127.0.0.1:3,{HOSTNAME}:8"}, 60)
    code, out = job.finish()
    assert code == 1, out
    assert ("Horovod was shutdown because number of resets during elastic job exceeded "
            "limit: 1") in out, out
    assert "elastic job failed" in out and "2 failed" in out, out
    assert "blacklisting host 127.0.0.1" in out and f"blacklisting host {HOSTNAME}" in out
    assert not job.results()
    no_orphans(job)


def test_fewer_than_min_np_times_out(tmp_path: Path) -> None:
    """Test 5: after a failure fewer than --min-np slots remain; the driver waits
    --elastic-timeout (the discovery could find more), then fails with a clear error and
    leaves no process behind."""
    t0 = time.monotonic()
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--elastic-timeout", "2",
                         "--host-discovery-script", "printf 'localhost:1\\n127.0.0.1:1\\n'"],
              {"ET_STEPS": "200", "ET_KILL": "127.0.0.1:3"}, 60)
    code, out = job.finish()
    assert code == 1, out
    assert "waiting for 2 slots, have 1" in out, out
    assert "Timed out after 2 s waiting for 2 slots; have 1 (localhost:1; blacklisted: " \
           "127.0.0.1)" in out, out
    assert "hvdrun stopped the elastic job" in out  # what the waiting survivor was told
    assert time.monotonic() - t0 < 30
    no_orphans(job)


def test_fixed_hosts_fewer_than_min_np_stops_at_once(tmp_path: Path) -> None:
    """The same with a fixed -H list: no slot can come back (the failed host is blacklisted
    for good), so the job stops at once instead of waiting --elastic-timeout (600 s)."""
    t0 = time.monotonic()
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1"],
              {"ET_STEPS": "200", "ET_KILL": "127.0.0.1:3"}, 60)
    code, out = job.finish()
    assert code == 1, out
    assert "waiting for 2 slots" not in out, out
    reason = ("Only 1 slot(s) left for --min-np 2, and no more can come: the hosts are the "
              "fixed list localhost:1,127.0.0.1:1 (-H/--hostfile) and 127.0.0.1 is "
              "blacklisted for good.")
    assert f"hvdrun stopped the elastic job: {reason}" in out, out
    assert f"hvdrun: elastic job failed: {reason}" in out, out
    assert time.monotonic() - t0 < 30
    no_orphans(job)


def _hvdrun(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **env)
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_the_first_discovery(tmp_path: Path, sig: int) -> None:
    """Ctrl-C or SIGTERM while the first run of a slow discovery script is under way: one
    line, exit 128 + signal, and the script's children are gone. Ctrl-C printed a traceback;
    SIGTERM killed hvdrun at once and the script ran on, owned by init."""
    pidfile = tmp_path / "sleep.pid"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {pidfile}\nwait\necho localhost:2\n")
    script.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "-np", "2",
                             "--host-discovery-script", str(script), "true"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    sleeper = None
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text().strip()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        sleeper = int(pidfile.read_text())
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + sig, (out, err)
        assert f"hvdrun: received {signal.Signals(sig).name} before the job started; " \
               "stopped." in err, err
        assert "Traceback" not in err, err
        deadline = time.monotonic() + 5
        while Path(f"/proc/{sleeper}").exists() and time.monotonic() < deadline:
            if Path(f"/proc/{sleeper}/stat").read_text().split()[2] == "Z":
                break
            time.sleep(0.05)
        else:
            assert not Path(f"/proc/{sleeper}").exists(), "the script's child outlived hvdrun"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if sleeper is not None:
            try:
                os.kill(sleeper, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_elastic_timeout_from_environment() -> None:
    """Without --elastic-timeout, HOROVOD_ELASTIC_TIMEOUT is the driver's timeout and the
    workers' value; the flag wins over it."""
    r = _hvdrun(["-np", "2", "--host-discovery-script", "echo localhost:1", "true"],
                {"HOROVOD_ELASTIC_TIMEOUT": "1"})
    assert r.returncode == 1 and "Timed out after 1 s waiting for 2 slots" in r.stderr, r.stderr
    show = ["-np", "1", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", "sh", "-c",
            "echo timeout=$HOROVOD_ELASTIC_TIMEOUT"]
    r = _hvdrun(show, {"HOROVOD_ELASTIC_TIMEOUT": "7"})
    assert r.returncode == 0 and "timeout=7\n" in r.stdout, r.stdout + r.stderr
    r = _hvdrun(["--elastic-timeout", "9", *show], {"HOROVOD_ELASTIC_TIMEOUT": "7"})
    assert r.returncode == 0 and "timeout=9\n" in r.stdout, r.stdout + r.stderr


def test_elastic_sampler_covers_dataset_once(tmp_path: Path) -> None:
    """Test 6 (torch): across a SIGKILL and rollback, the samples of the committed batches are
    exactly the dataset once; model, momentum and the backward_passes_per_step=2 accumulation
    (cut short on the survivor by the failure) are rolled back consistently."""
    pytest.importorskip("torch")
    # 60 samples, 2 per rank per batch: 15 batches at 2 ranks; the kill at batch 5 rolls back
    # to the commit after batch 4 (16 samples), the 44 left are 22 batches at 1 rank.
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
              {"ET_TORCH": "1", "ET_DATASET": "60", "ET_BATCH": "2", "ET_COMMIT": "2",
               "ET_SLEEP": "0.01", "ET_KILL": "127.0.0.1:5", "ET_BPPS": "2"}, 120)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0], out
    # SGD(lr=0.5, momentum=0.5) on an averaged gradient of 2 * base(step) per weight (two
    # backward passes per step add up).
    w, buf = 0.0, None
    for s in range(26):
        g = 2.0 * float(s % 7 - 3)
        buf = g if buf is None else 0.5 * buf + g
        w -= 0.5 * buf
    for r in res:
        assert sorted(r["seen"]) == list(range(60)), r["seen"]
        assert r["log"] == list(range(26)) and r["sizes"] == [2] * 4 + [1] * 22, r
        assert r["w"] == pytest.approx([w] * 4, abs=1e-5), (r["w"], w)
    assert "restoring the last commit" in out
    no_orphans(job)


def test_torch_host_added_between_commits_keeps_uncommitted_steps(tmp_path: Path) -> None:
    """Test 6b (torch): a host appears while the workers are between commits; the interrupt
    comes from `check_host_updates()`. Nothing is rolled back: the model, the optimizer, the
    sampler and the plain attributes (step, log, seen) all go on from where they were, so every
    step is applied once and every sample is seen (the old sync put the plain attributes back
    to the last commit and left the model and sampler as they were)."""
    pytest.importorskip("torch")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3",
                         "--host-discovery-script", f"cat {hosts}"],
              {"ET_TORCH": "1", "ET_DATASET": "120", "ET_BATCH": "2", "ET_COMMIT": "1000",
               "ET_CHECK": "1", "ET_SLEEP": "0.3"}, 120)
    job.wait_progress(2)
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [r["rank"] for r in res] == [0, 1, 2], out
    w, buf = 0.0, None  # SGD(lr=0.5, momentum=0.5), averaged gradient base(step)
    for s in range(res[0]["step"]):
        g = float(s % 7 - 3)
        buf = g if buf is None else 0.5 * buf + g
        w -= 0.5 * buf
    for r in res:
        assert r["log"] == list(range(r["step"])), r["log"]
        assert r["sizes"][0] == 2 and r["sizes"][-1] == 3, r["sizes"]
        assert sorted(set(r["seen"])) == list(range(120)), r["seen"]
        assert len(r["seen"]) < 120 + 6, r["seen"]  # padding of the last batch only
        assert r["w"] == pytest.approx([w] * 4, abs=1e-5), (r["w"], w)
    assert "hosts added" in out and "restoring the last commit" not in out, out
    no_orphans(job)


def test_torch_new_worker_outlives_the_old_world(tmp_path: Path) -> None:
    """Test 6c (torch): a worker joins, then every worker of the old world dies before the next
    commit. The new worker is the new rank 0 and restores its own snapshot: that must be the
    state it received (the old code kept its initial model there, next to the job's committed
    step, log and sampler: the final weights did not match the steps logged)."""
    pytest.importorskip("torch")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "3",
                         "--host-discovery-script", f"cat {hosts}"],
              {"ET_TORCH": "1", "ET_DATASET": "120", "ET_BATCH": "2", "ET_COMMIT": "3",
               "ET_SLEEP": "0.3", "ET_KILL_AT_SIZE": "3:localhost,127.0.0.1"}, 120)
    job.wait_progress(4)  # a commit (step 3) before the new worker comes
    hosts.write_text(f"localhost:1\n127.0.0.1:1\n{HOSTNAME}:1\n")
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert [(r["rank"], r["host"]) for r in res] == [(0, HOSTNAME)], out
    r = res[0]
    w, buf = 0.0, None  # SGD(lr=0.5, momentum=0.5), averaged gradient base(step)
    for s in range(r["step"]):
        g = float(s % 7 - 3)
        buf = g if buf is None else 0.5 * buf + g
        w -= 0.5 * buf
    assert r["log"] == list(range(r["step"])), r["log"]
    assert r["sizes"][0] == 2 and r["sizes"][-1] == 1, r["sizes"]
    assert sorted(set(r["seen"])) == list(range(120)), r["seen"]
    assert r["w"] == pytest.approx([w] * 4, abs=1e-5), (r["w"], w, r["log"])
    assert "restoring the last commit" in out and "2 reset(s)" in out, out
    no_orphans(job)


API_SCRIPT = r"""
import os, signal, time
import horovod

def train(steps):
    import numpy as np
    import collective as hvd
    from collective import elastic

    hvd.init()
    state = elastic.ObjectState(step=0, total=0.0)

    @elastic.run
    def loop(state):
        while state.step < steps:
            if state.step == 5 and os.environ["HOROVOD_HOSTNAME"] == "127.0.0.1":
                os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(hvd.allreduce(np.ones(1), name="x")[0])
            state.step += 1
            state.commit()
            time.sleep(0.02)

    loop(state)
    return hvd.rank(), hvd.size(), state.step, state.total

print("RESULT", horovod.run(train, args=(20,), num_proc=3, min_num_proc=2,
                            hosts="localhost:2,127.0.0.1:1"))
"""


def test_horovod_run_elastic() -> None:
    """horovod.run(..., min_num_proc=...): results of the last round's ranks."""
    pytest.importorskip("cloudpickle")  # the function is defined in __main__
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", API_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT [(0, 2, 20, 20.0), (1, 2, 20, 20.0)]" in proc.stdout, proc.stdout


def test_tensorflow_keras_state_sigkill(tmp_path: Path) -> None:
    """Keras `fit` under `horovod.tensorflow.keras.elastic`: of 2 workers one is SIGKILLed in
    epoch 2 (before step 9, after step 8 ran on both); the survivor restores the last commit
    (the end of epoch 1: steps 0-7), redoes step 8 alone, finishes, and every step is applied
    exactly once. The gradient allreduce fails inside Keras' `tf.function`, so this also covers
    turning that error back into a `HorovodInternalError`."""
    try:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    except ImportError as exc:
        from tests._spmd import skip_or_fail
        skip_or_fail(f"tensorflow/keras not installed ({exc})", "tensorflow")
    batches, epochs = 4, 4
    steps = batches * epochs
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
              {"ET_KERAS": "1", "ET_STEPS": str(steps), "ET_BATCHES": str(batches),
               "ET_COMMIT": "3", "ET_SLEEP": "0.05", "ET_KILL": "127.0.0.1:9",
               "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1",
               "TF_NUM_INTEROP_THREADS": "1"}, 150)
    code, out = job.finish()
    assert code == 0, out
    res = job.results()
    assert len(res) == 1, out
    r = res[0]
    assert r["host"] == "localhost" and r["rank"] == 0 and r["size"] == 1, r
    assert r["step"] == steps and r["log"] == list(range(steps)), r["log"]
    # Each epoch's averaged gradients are 1, 2, 3, 4 at any size; SGD lr 0.5.
    assert r["w"] == [-0.5 * 10.0 * epochs] * 4, r["w"]
    assert r["sizes"][:8] == [2] * 8 and set(r["sizes"][8:]) == {1}, r["sizes"]
    # Step 8 ran at size 2, was rolled back, and ran again: the survivor finished it twice.
    assert progress_steps(job)["progress.0"].count(9) == 2, progress_steps(job)
    assert "exited with status code 137" in out and "1 reset(s)" in out, out
    no_orphans(job)
