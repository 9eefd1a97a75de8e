"""The import graph: dependencies point one way.

Two kinds of checks:
* runtime: import a package in a fresh interpreter in which the forbidden packages are stubbed
  as `sys.modules[name] = None` (any import of them raises ImportError);
* static: parse every module's imports (including lazy, function-level ones) and check who
  imports whom.
Plus an import-time budget for `import collective`.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ["mpi4py", "cupy", "cupyx", "torch", "tensorflow", "jax", "jaxlib", "ray"]
# What framework adapters may import from collective: the user API, the adapter seam and the
# public modules the adapter seam's doc names.
FRAMEWORK_SEAM = {"collective", "collective.adapter", "collective.errors", "collective.types",
                  "collective.elastic"}
LAUNCHER_ALLOWED = {"collective.config", "collective.errors", "collective.rendezvous"}


def run_fresh(code: str, stubs=(), timeout: float = 60) -> dict:
    """Runs `code` in a fresh interpreter with `stubs` blocked; returns its JSON output."""
    prelude = "import sys, json\n" + "".join(f"sys.modules[{s!r}] = None\n" for s in stubs)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))})
    assert proc.returncode == 0, f"fresh interpreter failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def modules_of(package: str) -> list[str]:
    root = os.path.join(REPO, package)
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in sorted(files):
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), REPO)[:-3]
                mod = rel.replace(os.sep, ".")
                out.append(mod[:-len(".__init__")] if mod.endswith(".__init__") else mod)
    return sorted(out)


def _is_module(name: str) -> bool:
    path = os.path.join(REPO, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes inside module-level `if TYPE_CHECKING:` blocks (never run)."""
    out: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                out.update(id(sub) for sub in ast.walk(stmt))
    return out


def imports_of(module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement in `module`, and for
    every attribute chain that reaches a submodule (`collective.runtime.current()` imports
    `collective.runtime` as surely as an import statement does). `from X import Y` counts as an
    import of `X.Y` when that is a module, else of `X`. Imports under `if TYPE_CHECKING:` count
    as lazy (they never run)."""
    path = os.path.join(REPO, *module.split("."))
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    typing_only = _type_checking_only(tree)
    top = set()
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                break
            if id(sub) not in typing_only:
                top.add(id(sub))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append((a.name, id(node) in top))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[:len(base) - node.level + 1]
                name = ".".join(parent + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for a in node.names:  # `from X import Y` may import the submodule X.Y
                sub = f"{name}.{a.name}"
                found.append((sub if _is_module(sub) else name, id(node) in top))
        elif isinstance(node, ast.Attribute):
            chain = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in ("collective", "frameworks", "launcher"):
                dotted = [cur.id] + chain[::-1]
                for i in range(len(dotted), 1, -1):
                    if _is_module(".".join(dotted[:i])):
                        found.append((".".join(dotted[:i]), False))
                        break
    return found


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# -- runtime checks ----------------------------------------------------------------------------
def test_collective_imports_without_optional_packages():
    mods = [m for m in modules_of("collective") if m != "collective.__main__"]
    out = run_fresh(f"""
        import collective
        failed = {{}}
        for m in {mods!r}:
            try:
                __import__(m)
            except ImportError as exc:
                failed[m] = type(exc).__name__ + ": " + str(exc)
        print(json.dumps(failed))
    """, stubs=HEAVY + ["frameworks", "launcher", "horovod"])
    # Only engines whose backend is missing may fail, and they must say what to install.
    allowed = {"collective.engines.mpi"}
    beyond = {m for m in out if m not in allowed and not _under(m, ["collective.engines.nccl"])}
    assert not beyond, f"modules that need an optional package: {out}"
    for m, err in out.items():
        assert "EngineUnavailableError" in err or "install" in err, (m, err)


def test_import_collective_loads_no_backend_and_no_adapter():
    out = run_fresh("""
        import collective
        heavy = [m for m in sys.modules if m.split('.')[0] in
                 ('mpi4py', 'cupy', 'torch', 'tensorflow', 'jax', 'ray', 'frameworks',
                  'launcher')]
        print(json.dumps(heavy))
    """)
    assert out == [], f"`import collective` imported {out}"


def test_missing_backend_gives_an_install_hint():
    out = run_fresh("""
        from collective.config import read_env
        from collective.engines import create_backend
        from collective.errors import EngineUnavailableError
        try:
            create_backend("mpi", read_env({}))
        except EngineUnavailableError as exc:
            print(json.dumps(str(exc)))
        else:
            print(json.dumps("no error"))
    """, stubs=["mpi4py"])
    assert "pip install" in out and "mpi" in out


def test_import_time_budget():
    out = run_fresh("""
        import time
        t0 = time.perf_counter()
        import numpy
        t1 = time.perf_counter()
        import collective
        t2 = time.perf_counter()
        print(json.dumps([t1 - t0, t2 - t1]))
    """)
    numpy_s, own_s = out
    assert own_s < 0.5, f"`import collective` took {own_s:.3f} s on top of numpy"


def test_launcher_imports_without_numpy_torch_or_backends_except_numpy():
    mods = [m for m in modules_of("launcher") if not _under(m, ["launcher.ray"])
            and m != "launcher.__main__"]
    out = run_fresh(f"""
        failed = {{}}
        for m in {mods!r}:
            try:
                __import__(m)
            except ImportError as exc:
                failed[m] = str(exc)
        print(json.dumps(failed))
    """, stubs=HEAVY + ["frameworks"])
    assert out == {}, f"launcher modules that need a heavy package: {out}"


def test_launcher_imports_with_the_stdlib_alone():
    out = run_fresh("""
        import launcher.cli, launcher.launch
        print(json.dumps(sorted(m for m in sys.modules if m.startswith('collective'))))
    """, stubs=HEAVY + ["numpy", "frameworks"])
    assert set(out) <= LAUNCHER_ALLOWED | {"collective"}


@pytest.mark.parametrize("fw", [d for d in sorted(os.listdir(os.path.join(REPO, "frameworks")))
                                if os.path.isdir(os.path.join(REPO, "frameworks", d))
                                and not d.startswith("_")])
def test_each_framework_imports_without_the_others(fw):
    import importlib.util
    own = {"torch": "torch", "tensorflow": "tensorflow", "jax": "jax"}.get(fw, fw)
    if importlib.util.find_spec(own) is None:
        pytest.skip(f"{own} is not installed")
    others = [p for p in ("torch", "tensorflow", "jax", "ray") if p != own]
    siblings = [f"frameworks.{d}" for d in os.listdir(os.path.join(REPO, "frameworks"))
                if d != fw and not d.startswith("_") and d.isidentifier()]
    out = run_fresh(f"""
        import frameworks.{fw}
        print(json.dumps(sorted(m for m, mod in sys.modules.items()
                                if mod is not None and m.startswith('frameworks.') and
                                m.split('.')[1] != '{fw}' and
                                not m.split('.')[1].startswith('_'))))
    """, stubs=others + siblings + ["launcher"], timeout=90)
    assert out == [], f"frameworks.{fw} imported {out}"


def test_shared_framework_modules_import_no_framework():
    # frameworks/_*.py serve every adapter: no framework, no adapter, no launcher in them.
    shared = [m for m in modules_of("frameworks")
              if m.count(".") == 1 and m.split(".")[1].startswith("_")]
    assert "frameworks._common" in shared and "frameworks._compression" in shared, shared
    adapters = [f"frameworks.{d}" for d in os.listdir(os.path.join(REPO, "frameworks"))
                if not d.startswith("_") and d.isidentifier()]
    bad = [(m, i) for m in shared for i, _ in imports_of(m)
           if _under(i, ["torch", "tensorflow", "jax", "ray", "launcher"] + adapters)]
    assert bad == [], f"shared framework modules import a framework or adapter: {bad}"


# -- static checks -----------------------------------------------------------------------------
def test_collective_never_imports_frameworks_or_launcher():
    bad = [(m, i) for m in modules_of("collective") for i, _ in imports_of(m)
           if _under(i, ["frameworks", "launcher", "horovod"])]
    assert bad == []


def test_collective_imports_heavy_packages_only_lazily():
    bad = [(m, i) for m in modules_of("collective") for i, top in imports_of(m)
           if top and _under(i, HEAVY) and not m.startswith("collective.engines.")]
    assert bad == [], f"module-level imports of optional packages: {bad}"


def test_engines_do_not_import_negotiation_side():
    bad = [(m, i) for m in modules_of("collective") if m.startswith("collective.engines")
           for i, _ in imports_of(m)
           if _under(i, ["collective.coordinator", "collective.negotiation",
                         "collective.fusion", "collective.runtime"])]
    assert bad == []


def test_negotiation_and_fusion_are_pure():
    for m in ("collective.negotiation", "collective.fusion", "collective.stall",
              "collective.autotune"):
        names = {i for i, _ in imports_of(m)}
        assert not names & {"threading", "socket", "subprocess", "os"}, (m, names)
        assert not any(_under(i, ["collective.engines", "collective.coordinator",
                                  "collective.runtime"]) for i in names), (m, names)


def test_launcher_imports_only_names_and_exceptions_from_collective():
    bad = []
    for m in modules_of("launcher"):
        for i, top in imports_of(m):
            if _under(i, ["collective"]) and not _under(i, LAUNCHER_ALLOWED):
                bad.append((m, i))
            # launcher.ray's submodules need Ray at import; the package checks for it first and
            # names the `ray` extra, so only they may import it at module level.
            ray_ok = m.startswith("launcher.ray.") and _under(i, ["ray"])
            if _under(i, ["frameworks"]) or (top and _under(i, ["numpy"] + HEAVY) and not ray_ok):
                bad.append((m, i))  # (lazy probes, e.g. `hvdrun --check-build`, are fine)
            if _under(i, ["ray"]) and not m.startswith("launcher.ray"):
                bad.append((m, i))
    assert bad == [], f"launcher imports beyond collective.config/errors/rendezvous: {bad}"


def test_frameworks_do_not_import_each_other_or_collective_internals():
    bad = []
    for m in modules_of("frameworks"):
        parts = m.split(".")
        fw = parts[1] if len(parts) > 1 else None
        for i, _ in imports_of(m):
            if _under(i, ["collective"]) and i not in FRAMEWORK_SEAM:
                bad.append((m, i))
            if i.startswith("frameworks.") and fw and not fw.startswith("_"):
                other = i.split(".")[1]
                if other != fw and not other.startswith("_"):
                    bad.append((m, i))
            if _under(i, ["launcher"]):
                bad.append((m, i))
    assert bad == [], (f"layering violations in frameworks/ (adapters import only "
                       f"{sorted(FRAMEWORK_SEAM)}): {bad}")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_collective_has_no_import_cycles():
    mods = set(modules_of("collective"))
    graph = {m: {i for i, top in imports_of(m) if top and i in mods and i != m} for m in mods}
    assert _cycle(graph) is None, f"import cycle among collective modules: {_cycle(graph)}"


def test_the_static_checks_see_submodule_imports():
    # `from collective import runtime` is an import of collective.runtime, and so is an
    # attribute chain that reaches it.
    import tempfile
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "frameworks")) as d:
        name = os.path.basename(d)
        with open(os.path.join(d, "probe.py"), "w") as f:
            f.write("import collective\nfrom collective import runtime, rank\n"
                    "def f():\n    return collective._current.current()\n")
        found = {i for i, _ in imports_of(f"frameworks.{name}.probe")}
    assert {"collective", "collective.runtime", "collective._current"} <= found, found
    assert "collective.rank" not in found
