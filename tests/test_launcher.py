"""The suite's fork server (support/launcher.py): a forked ``vllm-mlx`` run is what a fresh process gives.

Its children serve every other server test; here one flag error through the plugin is run both ways and compared
byte for byte, and a signal reaches a forked server as it reaches a plain subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import launcher
from support.server import serve

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.environ.get(launcher.DISABLE_VAR) == "0",
                                reason="the fork server runs on Linux, unless disabled")


def _without_import_notices(text: str) -> str:
    # transformers prints this at its import: a fresh process imports it, a fork was given it imported
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("[transformers]"))


def test_a_forked_flag_error_equals_a_fresh_process() -> None:
    cmd = [launcher.VLLM_MLX, "serve", "m", "--plugins", "mtp-routing", "--mtp-max-batch-size", "x"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(os.devnull, "w") as null:
        proc = launcher.popen(cmd, env=env, stdout=null, stderr=null)
        assert isinstance(proc, launcher.ForkedProcess)  # it was forked, so the comparison below means something
        assert proc.wait(60) == 2
    forked = launcher.run(cmd, env=env, timeout=60)
    fresh = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == (2, "")
    assert _without_import_notices(forked.stderr) == _without_import_notices(fresh.stderr)
    assert "argument --mtp-max-batch-size: must be an integer >= 1, got 'x'" in forked.stderr


def test_a_forked_server_stops_on_sigterm_like_a_subprocess(tiny_vlm_fp32: Path, tmp_path: Path) -> None:
    with serve(tiny_vlm_fp32, "--plugins", "mtp-routing", "--continuous-batching", "--mllm", log_dir=tmp_path) as server:
        assert isinstance(server.proc, launcher.ForkedProcess)
        with server.client() as c:
            assert c.get("/health").status_code == 200
        server.proc.terminate()
        assert server.proc.wait(30) == -15  # uvicorn re-raises SIGTERM once shut down, as with subprocess.Popen
    assert "Application shutdown complete." in server.log()


def test_a_forked_program_sees_what_a_fresh_interpreter_sees(tmp_path: Path) -> None:
    """`python -c` through a fork server of its own whose PYTHONPATH the run extends: the same argv, import path,
    output and exit status as a fresh interpreter; an extra path that shadows a module the fork server imported
    makes the child exec afresh."""
    base, extra, shadow = (tmp_path / name for name in ("base", "extra", "shadow"))
    for folder in (base, extra, shadow):
        folder.mkdir()
    (extra / "extra_module.py").write_text("WHERE = 'extra'\n")
    (shadow / "json.py").write_text("")
    code = "\n".join([
        "import sys, extra_module",
        "print('preloaded', 'json' in sys.modules)",
        "print(sys.argv, sys.path[:3], extra_module.WHERE)",
        "raise ValueError('from the program')",
    ])
    with launcher.of_own({**os.environ, "PYTHONPATH": str(base)}, preload=["json"]) as fork_server:
        assert fork_server is not None
        for paths, forked_expected in (([base, extra], True), ([base, shadow, extra], False)):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
            cmd = [sys.executable, "-c", code, "a", "b"]
            forked = launcher.run(cmd, env=env, timeout=120, via=fork_server)
            fresh = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            assert f"preloaded {forked_expected}" in forked.stdout  # forked, or run afresh where a fork would differ
            assert forked.stdout.replace("preloaded True", "preloaded False") == fresh.stdout
            assert f"['-c', 'a', 'b'] ['', '{paths[0]}', '{paths[1]}'] extra" in fresh.stdout
            assert forked.returncode == fresh.returncode == 1
            assert _without_import_notices(forked.stderr) == _without_import_notices(fresh.stderr)
            assert fresh.stderr.endswith("ValueError: from the program\n")
