"""The package as users install it: build the sdist and wheel, install the wheel into a fresh venv.

The fresh venv gets its heavy dependencies (vllm-mlx, mlx, ...) from this test run's environment
through a path line in a .pth file: a plain path line adds the folder to ``sys.path`` without
running that folder's own ``.pth`` files, so neither this checkout's editable install nor its
bootstrap line is active there. Only the wheel's own files can make the plugin work in it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vllm_mlx_mtp_routing"
SUPPORT = Path(__file__).resolve().parent / "support"  # the test support package (tests/support), never shipped
BOOTSTRAP = "vllm_mlx_mtp_routing_bootstrap.pth"
# What the `vllm-mlx` console script runs (pip writes the same two lines).
RUN_CLI = "import sys; from vllm_mlx.cli import main; sys.argv = ['vllm-mlx', *sys.argv[1:]]; sys.exit(main())"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "hatchling", "build", "-d", str(out)], cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def test_wheel_has_bootstrap_at_root_and_entry_point(built: tuple[Path, Path]) -> None:
    wheel, sdist = built
    names = zipfile.ZipFile(wheel).namelist()
    assert BOOTSTRAP in names  # at the root: site-packages runs it at interpreter start
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm_mlx.plugins]" in text and "mtp-routing = vllm_mlx_mtp_routing.plugin" in text
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "models/"))]
    # no test support: no folder of that name, no file named as one of its modules
    support = {p.name for p in SUPPORT.glob("*.py")} - {"__init__.py"}
    assert support  # the check below means something
    shipped = [n for n in names if {"testing", "support", "tests"} & set(n.split("/")[:-1]) or n.rsplit("/", 1)[-1] in support]
    assert not shipped, f"test support in the wheel: {shipped}"
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    assert any(m.endswith("/vllm_mlx_mtp_routing/plugin.py") for m in members)
    assert any(m.endswith("/README.md") for m in members)


@pytest.mark.slow
def test_wheel_installed_in_fresh_venv_serves_help(built: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, _ = built
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip costs ~4 s of CPU): this run's pip installs into it with --python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    assert (site / BOOTSTRAP).is_file()

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_MLX_PLUGINS")}
    where = subprocess.run([str(py), "-c", "import vllm_mlx_mtp_routing as m; print(m.__file__)"], cwd=tmp_path,
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(site), where  # the wheel's copy, not this checkout
    result = subprocess.run([str(py), "-c", RUN_CLI, "serve", "--plugins", "mtp-routing", "--help"], cwd=tmp_path,
                            env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--plugins", "plugin mtp-routing", "--scheduler-policy", "--scheduler-headroom-gb", "--mtp-schedule"):
        assert flag in result.stdout


def test_package_imports_no_test_support() -> None:
    """Nothing in the package imports the test support (tests/support, imported as ``support``), deferred or not."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            for name in names:
                top = name.lstrip(".").split(".")
                if top[0] in ("support", "tests") or "testing" in top:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not found


def _package_imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports: every import statement (deferred and type-only ones included), a
    relative import resolved, ``from pkg import name`` read as the submodule where one exists, else the package."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, is_package) in modules.items():
        base = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                prefix = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(prefix + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                found = subs if len(subs) == len(node.names) else [target, *subs]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {m for m in found if m in modules and m != name}
    return graph


def test_the_package_has_no_import_cycle() -> None:
    """No module reaches itself through imports, deferred or type-only ones included."""
    graph = _package_imports()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
