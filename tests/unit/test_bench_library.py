"""benchmarks/: the scripts import ringvod from a copy named on PYTHONPATH before their own
checkout, and so do the processes they start (an A/B of two libraries depends on it)."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")
LIBRARY = ("collective", "frameworks", "horovod", "launcher")
# A script that imports ringvod, in its own process or in those it starts.
_USES = re.compile(r'\b(import|from) (collective|frameworks|horovod)\b|"-m", "launcher"')
# negotiation_cpu.py is given the libraries it compares (--tree): see the last test.
SCRIPTS = sorted(f for f in os.listdir(BENCH)
                 if f.endswith(".py") and not f.startswith("_") and f != "negotiation_cpu.py"
                 and _USES.search(open(os.path.join(BENCH, f)).read()))


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> str:
    """Another copy of the library, as an A/B names on PYTHONPATH."""
    root = tmp_path_factory.mktemp("copy")
    for d in LIBRARY:
        shutil.copytree(os.path.join(REPO, d), root / d,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return str(root)


def test_the_scripts_that_use_the_library_are_found():
    assert {"gpu_resnet.py", "tcp_allreduce.py", "autotune_cpu.py", "ray_vs_hvdrun.py",
            "timeline_overhead.py"} <= set(SCRIPTS)


def test_use_checkout_puts_the_checkout_after_pythonpath(copy, tmp_path):
    code = (f"import sys; sys.path.insert(0, {BENCH!r}); import _library; "
            "_library.use_checkout(); print(_library.where())")

    def imported(pythonpath: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, cwd=str(tmp_path),
                              env=dict(os.environ, PYTHONPATH=pythonpath)).stdout.strip()

    assert imported(copy) == copy
    assert imported("") == REPO


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(BENCH)
                                         if f.endswith(".py") and f != "_library.py"))
def test_scripts_put_only_their_own_folder_on_sys_path(script):
    """The checkout goes on sys.path through `_library.use_checkout()` only."""
    own = {"HERE", "_HERE", "os.path.dirname(os.path.abspath(__file__))"}
    tree = ast.parse(open(os.path.join(BENCH, script)).read())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) == "sys.path"):
            assert ast.unparse(node.args[-1]) in own, ast.unparse(node)
    if script in SCRIPTS:
        calls = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Expr)]
        assert "_library.use_checkout()" in calls


# gpu_*.py import torch when they start (seconds each): the static test above covers them.
@pytest.mark.parametrize("script", [s for s in SCRIPTS if not s.startswith("gpu_")])
def test_scripts_import_a_copy_named_on_pythonpath_first(script, copy, tmp_path):
    """What a script sets up when it starts (runpy: all but `main()`) leaves the copy first."""
    code = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); runpy.run_path(sys.argv[2]); "
            "import collective, os; print(os.path.dirname(os.path.dirname(collective.__file__)))")
    p = subprocess.run([sys.executable, "-c", code, BENCH, os.path.join(BENCH, script)],
                       capture_output=True, text=True, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=copy))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == copy


class _Started(Exception):
    pass


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH,
                                                                                 name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_NS = argparse.Namespace
# Each script's first child process: the call that starts it, for a script module `m`.
_STARTS = {
    "allreduce_cpu": lambda m, tmp: m._launch(2, ["--part", "mpi"]),
    "autotune_cpu": lambda m, tmp: m.run_one({}, _NS(np=2, torch=False, tensors=1, kib=1), 1),
    "elastic_recovery": lambda m, tmp: m.run_once("2->1"),
    "ray_vs_hvdrun": lambda m, tmp: m._hvdrun(2, "startup", {}),
    "tcp_allreduce": lambda m, tmp: m.drive(_NS(sizes="4096", variants=["tcp"], rounds=1,
                                                np=2, scale=0.1, timeout=5)),
    "tf_keras_vs_mwms": lambda m, tmp: m.run_ringvod(
        _NS(mode="tcp", np=2, threads=1, timeout=5, batch_size=1, image_size=8, num_classes=2,
            warmup=1, steps=1), "ringvod-loop"),
    "timeline_overhead": lambda m, tmp: m.e2e(2, 1, 1, 1, tmp),
    "torch_cpu_vs_ddp": lambda m, tmp: m.run_ringvod(
        _NS(mode="tcp", np=2, threads=1, timeout=5, example=False, model="small_cnn",
            batch_size=1, image_size=8, num_classes=2, num_warmup_batches=1,
            num_batches_per_iter=1, num_iters=1)),
}


def test_every_script_that_starts_processes_is_checked():
    started = {s[:-3] for s in SCRIPTS
               if re.search(r"subprocess\.(run|call|Popen)", open(os.path.join(BENCH, s)).read())}
    assert started == set(_STARTS)


@pytest.mark.parametrize("name", sorted(_STARTS))
def test_started_processes_import_a_copy_named_on_pythonpath_first(name, monkeypatch, tmp_path):
    """The child's PYTHONPATH starts with the caller's entries, then the checkout; one started
    with `python -m` or `-c` (which put the working folder first) runs where no library is."""
    seen = {}

    def start(cmd, *args, env=None, cwd=None, **kwargs):
        seen.update(cmd=cmd, env=env, cwd=cwd)
        raise _Started

    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts add to it when loaded
    module = _load(name)
    other = str(tmp_path / "other")
    monkeypatch.setenv("PYTHONPATH", other)
    for fn in ("run", "call", "Popen"):
        monkeypatch.setattr(subprocess, fn, start)
    monkeypatch.setattr(shutil, "which", lambda cmd: "/usr/bin/" + cmd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(_Started):
        _STARTS[name](module, str(tmp_path))
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[:2] == [other, REPO]
    if "-m" in seen["cmd"] or "-c" in seen["cmd"]:
        cwd = seen["cwd"] or os.getcwd()
        assert not any(os.path.exists(os.path.join(cwd, d)) for d in LIBRARY), cwd


def test_negotiation_children_run_in_their_tree(monkeypatch, tmp_path):
    """negotiation_cpu.py's `python -c` children import the tree they measure."""
    seen = {}

    def start(cmd, *args, env=None, cwd=None, **kwargs):
        seen.update(env=env, cwd=cwd)
        raise _Started

    module = _load("negotiation_cpu")
    monkeypatch.setattr(subprocess, "Popen", start)
    monkeypatch.setattr(subprocess, "run", start)
    tree = str(tmp_path)
    for call in (lambda: module.rounds(tree, 1, 1), lambda: module.codec([tree], 1, 1)):
        seen.clear()
        with pytest.raises(_Started):
            call()
        assert seen["cwd"] == tree and seen["env"]["PYTHONPATH"] == tree
