"""hvdrun's MPI launch: Open MPI's saturating `op/avx` component is excluded unless the user
chose the reduction components, and leftovers of killed Open MPI jobs are cleaned up."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from launcher.hosts import HostInfo
from launcher.mpirun import build_mpirun_command, parse_mpi_version

OMPI5 = parse_mpi_version("mpirun (Open MPI) 5.0.11\n")
OMPI40 = parse_mpi_version("mpirun (Open MPI) 4.0.7\n")
HOSTS = [HostInfo("localhost", 2)]


def _argv(impl=OMPI5, env=None, mpi_args=None) -> list[str]:
    return build_mpirun_command(impl, num_proc=2, hosts=HOSTS, command=["x"], env=env or {},
                                mpi_args=mpi_args)


def _has_op_exclusion(argv: list[str]) -> bool:
    return any(argv[i:i + 3] == ["-mca", "op", "^avx"] for i in range(len(argv)))


def test_open_mpi_launch_excludes_the_saturating_avx_op(monkeypatch) -> None:
    monkeypatch.delenv("OMPI_MCA_op", raising=False)
    assert _has_op_exclusion(_argv())
    assert not _has_op_exclusion(_argv(OMPI40))  # no such component before 4.1


@pytest.mark.parametrize("how", ["env", "mca", "dash-dash-mca"])
def test_a_users_own_op_setting_is_kept(how, monkeypatch) -> None:
    monkeypatch.delenv("OMPI_MCA_op", raising=False)
    if how == "env":
        argv = _argv(env={"OMPI_MCA_op": "avx"})
    else:
        flag = "-mca" if how == "mca" else "--mca"
        argv = _argv(mpi_args=f"{flag} op avx")
        assert argv[-4:-1] == [flag, "op", "avx"]
    assert not _has_op_exclusion(argv)
