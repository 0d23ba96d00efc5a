"""The main job on the embedded tiny model: serve it with the plugin and answer a text and an image request.

Uses the committed trained checkpoint (models/tiny-qwen35-trained) when present, else builds the random
tiny Qwen3.5 VLM with the project's builder. Everything runs on 127.0.0.1; nothing is downloaded. The
server log and any built model live in a temporary folder that is removed at the end (its log is printed
if the server fails).

The trained model has 10M parameters and learnt only Python source: it continues code plausibly and
answers questions with code-flavoured fragments. That is expected; the demo shows the serving paths.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*

from support.server import png_data_url, serve  # noqa: E402
from support.tiny_model import build_tiny_qwen35_vlm  # noqa: E402


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="mtp-routing-demo-"))
    try:
        return run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path) -> int:
    import openai

    trained = ROOT / "models" / "tiny-qwen35-trained"
    if (trained / "config.json").is_file():
        model = trained
    else:
        model = work / "tiny-qwen35"
        build_tiny_qwen35_vlm(model, dtype="bfloat16")
    flags = ["--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp"]
    print(f"serving {model} with: vllm-mlx serve <model> {' '.join(flags)}", flush=True)
    with serve(model, *flags, log_dir=work) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="demo", max_retries=0)
        text = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "def fibonacci(n):"}], max_tokens=24, temperature=0
        )
        image = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What colour is this?"},
                {"type": "image_url", "image_url": {"url": png_data_url((200, 30, 30))}},
            ]}],
            max_tokens=12,
            temperature=0,
        )
        import httpx

        status = httpx.get(f"{server.url}/v1/status").json()
        print("text  ->", repr(text.choices[0].message.content), text.usage)
        print("image ->", repr(image.choices[0].message.content), image.usage)
        print("plugins status ->", json.dumps(status.get("plugins"), indent=1))
        print("(a 10M-parameter model trained on Python source: code-like answers are expected)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
