"""What the server tells its operator, through the real server and CLI: why routing is off (one WARNING and the
status), each request's path in the log, the host's own status counters with the text path counted in, a missing
model path in one line, and a start-up without known-harmless third-party notices."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support.plugin_status import SHARED_FLAGS, plugin_status, wait_idle
from support.server import VLLM_MLX, Server, png_data_url, serve

pytestmark = pytest.mark.server

FALLBACK = "a host drafter was requested and the text path has no MTP head"


def route_lines(server: Server) -> list[str]:
    return [ln[ln.index("[ROUTE]"):] for ln in server.log().splitlines() if "[ROUTE]" in ln]


def chat(server: Server, content: object, **extra: object) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}
    r = server.post("/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def image(text: str) -> list[dict]:
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": png_data_url((10, 200, 10))}}]


def test_without_continuous_batching_one_warning_and_the_status_says_why(tiny_vlm_bf16: Path, tmp_path: Path) -> None:
    with serve(tiny_vlm_bf16, "--plugins", "mtp-routing", "--mllm", log_dir=tmp_path) as server:
        routing = plugin_status(server)["routing"]
        chat(server, "def f():")  # served by the host as it stands
        log = server.log()
    ours = [ln for ln in log.splitlines() if ln.startswith("WARNING:vllm_mlx_mtp_routing")]
    assert len(ours) == 1, ours
    assert "routing is off" in ours[0] and "without --continuous-batching" in ours[0]
    assert ours[0].endswith("To route: add --continuous-batching")
    assert routing == {"enabled": False, "reason": routing["reason"], "fix": "add --continuous-batching"}
    assert "without --continuous-batching" in routing["reason"]
    assert "[ROUTE]" not in log  # nothing is routed


def test_each_request_logs_its_path_once(tiny_vlm_bf16: Path, shared_server: Callable[..., Server]) -> None:
    server = shared_server(tiny_vlm_bf16, *SHARED_FLAGS)
    before = len(route_lines(server))
    chat(server, "def g():", n=2)  # n copies: one request, one line
    chat(server, image("Describe"))
    chat(server, "hello", mllm_draft=True)  # the text path of this server has no MTP head: a fallback
    assert route_lines(server)[before:] == [
        "[ROUTE] text path", "[ROUTE] text path, media rows: 1 image(s)", f"[ROUTE] mlx-vlm path (fallback): {FALLBACK}",
    ]
    assert plugin_status(server)["routing"]["enabled"] is True
    wait_idle(server, within=2.0)


def test_the_hosts_own_counters_include_the_text_path(tiny_vlm_bf16: Path, shared_server: Callable[..., Server]) -> None:
    """vllm-mlx's top-level total_requests_processed, tokens and cache block count the text path's requests too."""
    server = shared_server(tiny_vlm_bf16, *SHARED_FLAGS)
    before = server.get("/v1/status").json()
    prompt = "import os\nimport sys\n\ndef main(argv=None):"
    outs = [chat(server, prompt), chat(server, prompt), chat(server, image("What is this?"))]  # the second one hits
    after = server.get("/v1/status").json()
    assert after["total_requests_processed"] - before["total_requests_processed"] == 3
    completion = sum(o["usage"]["completion_tokens"] for o in outs)
    assert after["total_completion_tokens"] - before["total_completion_tokens"] == completion
    assert after["total_prompt_tokens"] - before["total_prompt_tokens"] >= sum(o["usage"]["prompt_tokens"] for o in outs[:2])
    cache, cached = after["cache"], plugin_status(server)["prefix_cache"]
    text, host = cache["by_path"]["text"], cache["by_path"]["mlx_vlm"]
    assert text["hits"] == cached["hits"] and text["tokens_saved"] == cached["hit_tokens"]
    assert text["hits"] - before["cache"]["by_path"]["text"]["hits"] >= 1
    assert cache["hits"] == text["hits"] + (host or {}).get("hits", 0)
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_idle(server, within=2.0)


def _fresh_env() -> dict[str, str]:
    """As a shell's: this process imported mlx-lm and mlx-vlm, which set transformers' verbosity for themselves."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for name in ("VLLM_MLX_PLUGINS", "TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):
        env.pop(name, None)
    return env


def _fresh_serve(model: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter, not the suite's fork server (which imported transformers before the bridge could act)."""
    return subprocess.run([VLLM_MLX, "serve", model, "--plugins", "mtp-routing"], capture_output=True, text=True,
                          env=_fresh_env(), cwd=tmp_path, timeout=120)


def test_a_missing_local_model_is_one_line_and_start_up_is_quiet(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny-qwen35").mkdir(parents=True)
    result = _fresh_serve("models/tiny-qwen35b", tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "vllm-mlx serve: error: argument model: no such folder: 'models/tiny-qwen35b' (did you mean models/tiny-qwen35?)"
    ]
    # the notice dropped above is there without the plugin: the check above can fail
    notice = subprocess.run([sys.executable, "-c", "import transformers"], capture_output=True, text=True,
                            env=_fresh_env(), timeout=120)
    if "PyTorch was not found" not in notice.stderr:
        pytest.skip("this environment has PyTorch: transformers has no notice to drop")


def test_a_model_neither_local_nor_cached_offline_is_one_line(tmp_path: Path) -> None:
    from test_bridge_cli import run_cli

    result = run_cli("serve", "nobody-at-all/no-such-model", "--plugins", "mtp-routing", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    [line] = [ln for ln in result.stderr.splitlines() if "error" in ln]
    assert line.startswith("vllm-mlx serve: error: argument model: 'nobody-at-all/no-such-model' is neither a local folder")
    assert "HF_HUB_OFFLINE=1" in line and "Downloading" not in result.stderr
