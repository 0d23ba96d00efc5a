"""docs/plugin-api.md's plugin example, as written, loaded by the real server: it refuses a flag and a request."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
from test_bridge_cli import make_plugin, run_cli

from support.server import serve

REPO = Path(__file__).resolve().parents[1]


def doc_example() -> str:
    section = (REPO / "docs" / "plugin-api.md").read_text().split("## Writing a plugin", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/plugin-api.md's plugin section lost its example"
    return match.group(1)


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_plugin(tmp_path_factory.mktemp("example"), "readme-example", "readme_example_mod", doc_example())


def test_example_refuses_a_bad_flag(example_dir: Path) -> None:
    result = run_cli("serve", "m", "--plugins", "readme-example", "--max-prompt-chars", "-1", path=example_dir)
    assert result.returncode == 2
    assert "argument --max-prompt-chars: must be >= 0" in result.stderr


@pytest.mark.server
def test_example_refuses_a_request(example_dir: Path, tiny_vlm_bf16: Path, tmp_path: Path, monkeypatch) -> None:
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(example_dir), os.environ.get("PYTHONPATH")])))
    with serve(tiny_vlm_bf16, "--plugins", "readme-example", "--max-prompt-chars", "20", "--continuous-batching",
               "--mllm", log_dir=tmp_path) as server:
        client = server.openai(timeout=120)
        ok = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens > 0
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=server.model, max_tokens=2,
                                           messages=[{"role": "user", "content": "x" * 50}])
        assert refused.value.status_code == 413
        assert "prompt longer than 20 characters" in str(refused.value)
