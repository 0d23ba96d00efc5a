"""The bridge as users meet it: the stock ``vllm-mlx`` command in a process of its own.

Test plugins are hermetic: each lives in a temp dir with its own ``*.dist-info/entry_points.txt``,
put on ``PYTHONPATH`` for that process only. Programs that import ``vllm_mlx.cli`` themselves (``python -c``)
fork from an interpreter that imported transformers and nothing else (support/launcher.py), which is what that
import spends its ~1 s of CPU on: the bridge's import hook, armed at interpreter start, meets the host fresh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import launcher
from support.launcher import VLLM_MLX


def make_plugin(root: Path, name: str, module: str, source: str) -> Path:
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist = root / f"{module.replace('_', '-')}_plugin-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}-plugin\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text(f"[vllm_mlx.plugins]\n{name} = {module}\n")
    return root


def run_cli(*args: str, path: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("VLLM_MLX_PLUGINS", None) if env is None or "VLLM_MLX_PLUGINS" not in env else None
    if path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), full_env.get("PYTHONPATH", "")]))
    return launcher.run([VLLM_MLX, *args], env=full_env, timeout=timeout)


@pytest.fixture(scope="module")
def programs() -> Iterator[launcher.Launcher | None]:
    with launcher.of_own(os.environ, preload=["transformers"]) as fork_server:
        yield fork_server


def run_program(via: launcher.Launcher | None, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c code``, as ``subprocess.run`` with ``env`` (this process's by default) would run it."""
    return launcher.run([sys.executable, "-c", code], env=dict(os.environ) if env is None else env, timeout=120, via=via)


@pytest.fixture(scope="module")
def plugins_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    make_plugin(root, "broken", "broken_plugin_mod", "raise ImportError('libfoo is missing')\n")
    make_plugin(
        root,
        "typo",
        "typo_plugin_mod",
        """
        import pluggy
        hookimpl = pluggy.HookimplMarker("vllm_mlx")

        @hookimpl
        def vllm_mlx_stat():
            return {"never": "called"}
        """,
    )
    make_plugin(root, "undecorated", "undecorated_plugin_mod", "def vllm_mlx_validate_arg(args):\n    pass\n")
    make_plugin(
        root,
        "checked",
        "checked_plugin_mod",
        """
        import pluggy
        from vllm_mlx_mtp_routing.plugin_api.errors import FlagError
        hookimpl = pluggy.HookimplMarker("vllm_mlx")

        def positive(value):
            import argparse
            v = int(value)
            if v <= 0:
                raise argparse.ArgumentTypeError("must be positive")
            return v

        @hookimpl
        def vllm_mlx_add_cli_args(group):
            group.add_argument("--checked-count", type=positive, default=1, help="a checked flag")
            group.add_argument("--checked-limit", type=int, default=0)

        @hookimpl
        def vllm_mlx_validate_args(args):
            if args.checked_limit > 10:
                raise FlagError("--checked-limit", "cannot exceed 10")
            raise SystemExit("VALIDATED-OK")
        """,
    )
    return root


def test_unknown_plugin_exits_2_listing_installed() -> None:
    result = run_cli("serve", "some-model", "--plugins", "nope")
    assert result.returncode == 2
    assert "unknown plugin 'nope'" in result.stderr
    assert "mtp-routing" in result.stderr


def test_env_var_names_plugins_too() -> None:
    result = run_cli("serve", "some-model", env={"VLLM_MLX_PLUGINS": "nope"})
    assert result.returncode == 2
    assert "unknown plugin 'nope'" in result.stderr


def test_plugin_import_error_is_one_clear_line(plugins_dir: Path) -> None:
    result = run_cli("serve", "some-model", "--plugins", "broken", path=plugins_dir)
    assert result.returncode == 1
    assert "plugin 'broken' failed to load: ImportError: libfoo is missing" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name,hook,closest", [
    ("typo", "vllm_mlx_stat", "vllm_mlx_stats"),
    ("undecorated", "vllm_mlx_validate_arg", "vllm_mlx_validate_args"),
])
def test_misspelled_hook_fails_start_up_naming_it(plugins_dir: Path, name: str, hook: str, closest: str) -> None:
    result = run_cli("serve", "some-model", "--plugins", name, path=plugins_dir)
    assert result.returncode == 1
    assert f"plugin {name!r} implements unknown hook {hook!r} (did you mean {closest!r}?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_plugin_flags_show_in_help_only_when_enabled(plugins_dir: Path) -> None:
    enabled = run_cli("serve", "--plugins", "mtp-routing,checked", "--help", path=plugins_dir)
    assert enabled.returncode == 0
    assert "plugin checked" in enabled.stdout and "--checked-count" in enabled.stdout
    assert "plugin mtp-routing" in enabled.stdout
    stock = run_cli("serve", "--help", path=plugins_dir)
    assert "--checked-count" not in stock.stdout and "--plugins" in stock.stdout


def test_bad_flag_value_exits_2_naming_flag(plugins_dir: Path) -> None:
    result = run_cli("serve", "m", "--plugins", "checked", "--checked-count", "-3", path=plugins_dir)
    assert result.returncode == 2
    assert "argument --checked-count: must be positive" in result.stderr


def test_validate_hook_flag_error_exits_2_naming_flag(plugins_dir: Path) -> None:
    result = run_cli("serve", "m", "--plugins", "checked", "--checked-limit", "11", path=plugins_dir)
    assert result.returncode == 2
    assert "argument --checked-limit: cannot exceed 10" in result.stderr
    ok = run_cli("serve", "m", "--plugins", "checked", "--checked-limit", "3", path=plugins_dir)
    assert "VALIDATED-OK" in ok.stderr  # validation ran, before any model load


def test_abbreviated_plugins_flag_is_refused(plugins_dir: Path) -> None:
    result = run_cli("serve", "m", "--plug", "checked", path=plugins_dir)
    assert result.returncode == 2
    assert "--plugins" in result.stderr


def test_without_plugins_nothing_of_the_bridge_loads(programs: launcher.Launcher | None) -> None:
    code = (
        "import sys; sys.argv = ['vllm-mlx', 'serve', 'm']\n"
        "import vllm_mlx.cli as cli; p = cli.create_parser(); p.parse_args(sys.argv[1:])\n"
        "heavy = ('pluggy', 'vllm_mlx_mtp_routing.plugin_api.plugin_manager', 'vllm_mlx_mtp_routing.plugin', 'vllm_mlx.server')\n"
        "print(sorted(m for m in sys.modules if m in heavy))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MLX_PLUGINS"}
    out = run_program(programs, code, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_broken_bridge_never_breaks_stock_cli(programs: launcher.Launcher | None) -> None:
    code = (
        "import sys; sys.modules['vllm_mlx_mtp_routing.host.bridge'] = None\n"
        "sys.argv = ['vllm-mlx', 'serve', '--help']\n"
        "import vllm_mlx.cli as cli; cli.main()\n"
    )
    out = run_program(programs, code)
    assert out.returncode == 0
    assert "--continuous-batching" in out.stdout and "--plugins" not in out.stdout


def test_native_hooks_make_the_bridge_step_aside(programs: launcher.Launcher | None) -> None:
    # A host carrying the upstream patch has vllm_mlx.plugins; simulate it with a namespace overlay.
    code = (
        "import sys, types, importlib.util\n"
        "import vllm_mlx\n"
        "sys.modules['vllm_mlx.plugins'] = types.ModuleType('vllm_mlx.plugins')\n"
        "sys.modules['vllm_mlx.plugins'].__spec__ = importlib.util.spec_from_loader('vllm_mlx.plugins', loader=None)\n"
        "sys.argv = ['vllm-mlx', 'serve', '--help']\n"
        "import vllm_mlx.cli as cli\n"
        "print(getattr(cli, '_vllm_mlx_plugin_bridge', False))\n"
    )
    out = run_program(programs, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False")


def test_broken_bridge_with_plugins_requested_exits_1_in_one_line(programs: launcher.Launcher | None) -> None:
    code = (
        "import sys; sys.modules['vllm_mlx_mtp_routing.host.bridge'] = None\n"
        "sys.argv = ['vllm-mlx', 'serve', 'some-model']\n"
        "import vllm_mlx.cli as cli; cli.main()\n"
    )
    env = {**os.environ, "VLLM_MLX_PLUGINS": "mtp-routing"}
    out = run_program(programs, code, env)
    assert out.returncode == 1
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and "plugin bridge cannot be imported" in lines[0] and "ModuleNotFoundError" in lines[0]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_unimportable_package_with_plugins_requested_exits_1_in_one_line(tmp_path: Path, how: str) -> None:
    shadow = tmp_path / "vllm_mlx_mtp_routing"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('numpy version mismatch')\n")
    args = ("serve", "some-model", *(("--plugins", "mtp-routing") if how == "flag" else ()))
    result = run_cli(*args, path=tmp_path, env={"VLLM_MLX_PLUGINS": "mtp-routing"} if how == "env" else None)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "ImportError: numpy version mismatch" in lines[0], result.stderr


def test_empty_plugins_flag_exits_2() -> None:
    result = run_cli("serve", "some-model", "--plugins", "")
    assert result.returncode == 2
    assert "argument --plugins: expected one or more plugin names" in result.stderr


def test_flag_errors_name_the_flag_and_the_rule(tmp_path: Path) -> None:
    result = run_cli("serve", "some-model", "--plugins", "mtp-routing", "--mtp-max-batch-size", "x")
    assert result.returncode == 2
    assert "argument --mtp-max-batch-size: must be an integer >= 1, got 'x'" in result.stderr
    result = run_cli("serve", "some-model", "--plugins", "mtp-routing", "--scheduler-queue-timeout", "-3")
    assert result.returncode == 2 and "argument --scheduler-queue-timeout: must be a number of seconds > 0" in result.stderr
    result = run_cli("serve", "some-model", "--plugins", "mtp-routing", "--mtp-prompt-pairs", "0")
    assert result.returncode == 2 and "argument --mtp-prompt-pairs: must be an integer >= 1 or 'all', got 0" in result.stderr
    (tmp_path / "a-file").write_text("")
    result = run_cli("serve", "some-model", "--plugins", "mtp-routing", "--prefill-calibration-file", str(tmp_path / "a-file" / "c.json"))
    assert result.returncode == 2 and "argument --prefill-calibration-file: cannot keep calibrations in" in result.stderr


def test_serve_command_given_a_bare_namespace_uses_plugin_defaults(programs: launcher.Launcher | None) -> None:
    # A program that calls serve_command itself (the host's own tests do) with none of the plugin flags.
    code = (
        "import sys, types\n"
        "sys.argv = ['prog']\n"
        "import vllm_mlx.cli as cli\n"
        "cli.create_parser()\n"
        "import vllm_mlx_mtp_routing.host.bridge as bridge\n"
        "seen = {}\n"
        "import vllm_mlx_mtp_routing.host.server_hooks as hooks\n"
        "hooks.install = lambda state: seen.update(vars(state.args))\n"
        "ns = types.SimpleNamespace(plugins='mtp-routing', max_num_seqs=4)\n"
        "try:\n"
        "    cli.serve_command(ns)\n"
        "except BaseException:\n"
        "    pass  # the host's serve_command fails later on the bare namespace; the plugin part is done\n"
        "print(seen.get('mtp_schedule'), seen.get('scheduler_max_queue'), seen.get('mtp_routing_disable'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_MLX_PLUGINS"}
    out = run_program(programs, code, env)
    assert out.stdout.strip().splitlines()[-1] == "adaptive 128 False", out.stdout + out.stderr
