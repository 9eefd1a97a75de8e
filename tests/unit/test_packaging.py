"""pyproject.toml: the console scripts resolve (`horovodrun` is `hvdrun`) and the GPU extras
install the NCCL wheel that the engine's error message asks for."""
from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

pytestmark = pytest.mark.timeout(60)
REPO = pathlib.Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _load(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_horovodrun_is_an_alias_of_hvdrun():
    scripts = PROJECT["scripts"]
    assert scripts["horovodrun"] == scripts["hvdrun"]
    main = _load(scripts["horovodrun"])
    # Run the entry point the way the generated console script does.
    code = (f"import sys; from {scripts['horovodrun'].split(':')[0]} import "
            f"{scripts['horovodrun'].split(':')[1]} as m; sys.argv[0] = 'horovodrun'; "
            "sys.exit(m(['--version']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert main(["--version"]) == 0


def test_gpu_extras_install_the_nccl_wheel_the_engine_names():
    extras = PROJECT["optional-dependencies"]
    text = "".join(p.read_text() for p in (REPO / "collective/engines/nccl").glob("*.py"))
    for extra, wheel in (("gpu", "nvidia-nccl-cu12"), ("gpu-cu13", "nvidia-nccl-cu13")):
        assert wheel in text, f"the engine's message no longer names {wheel}"
        assert any(dep.startswith(wheel) for dep in extras[extra]), (extra, extras[extra])
