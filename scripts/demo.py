"""`make demo`: serve the embedded tiny model with the plugin and show, in a few lines, what the plugin adds.

A two-turn conversation (the second turn reuses the first one's prompt from the prefix cache), MTP's acceptance, and
where a text and an image request went. Uses the committed trained checkpoint (models/tiny-qwen35-trained) when
present, else builds the random tiny Qwen3.5 VLM with the project's builder. Everything runs on 127.0.0.1; nothing is
downloaded. The server's log and any built model live in a temporary folder removed at the end (the log is printed if
the server fails); the last full status is saved beside it in the system's temporary folder.

The trained model has 10M parameters and learnt only Python source: it continues code plausibly and answers
questions with code-like fragments. That is expected; the demo shows the serving paths.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test support package: support.*

from support.server import Server, png_data_url, serve  # noqa: E402
from support.tiny_model import build_tiny_qwen35_vlm  # noqa: E402

FLAGS = ["--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp"]
# A system prompt long enough that reusing it shows in the second turn's time to first token.
SYSTEM = "You complete Python code. The project's conventions, by example:\n\n" + "".join(
    f"def helper_{i}(items, key=None):\n    \"\"\"Return the items sorted by key, helper {i}.\"\"\"\n"
    f"    return sorted(items, key=key)\n\n" for i in range(12)
)
STATUS_FILE = Path(tempfile.gettempdir()) / "mtp-routing-demo-status.json"


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="mtp-routing-demo-"))
    try:
        return run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path) -> int:
    trained = ROOT / "models" / "tiny-qwen35-trained"
    random = not (trained / "config.json").is_file()
    model = work / "tiny-qwen35" if random else trained
    if random:
        build_tiny_qwen35_vlm(model, dtype="bfloat16")
    print(f"serving {model.name} with: vllm-mlx serve <model> {' '.join(FLAGS)}", flush=True)
    with serve(model, *FLAGS, log_dir=work) as server:
        turns = conversation(server)
        image = chat(server, [{"role": "user", "content": [
            {"type": "text", "text": "What colour is this?"},
            {"type": "image_url", "image_url": {"url": png_data_url((200, 30, 30))}},
        ]}])
        status = server.get("/v1/status").json()
        routes = [ln[ln.index("[ROUTE]") + 8:] for ln in server.log().splitlines() if "[ROUTE]" in ln]
        STATUS_FILE.write_text(json.dumps(status, indent=1))
        report(turns, image, status, routes, server.url)
    if random:
        print("(random weights: MTP acceptance near 0 is expected)")
    else:
        print("(a 10M-parameter model trained on Python source: code-like answers are expected)")
    return 0


def chat(server: Server, messages: list[dict[str, Any]], max_tokens: int = 32) -> dict[str, Any]:
    """One streamed request: its reply, usage and time to first token."""
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, first = "", {}, None
    t0 = time.perf_counter()
    with server.client(timeout=300) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content") or ""
                if delta and first is None:
                    first = time.perf_counter() - t0
                text += delta
            usage = chunk.get("usage") or usage
    return {"text": text, "usage": usage, "ttft": first if first is not None else time.perf_counter() - t0}


def conversation(server: Server) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def fibonacci(n):"}]
    first = chat(server, messages)
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "def factorial(n):"}]
    return [first, chat(server, messages)]


def report(turns: list[dict[str, Any]], image: dict[str, Any], status: dict[str, Any], routes: list[str], url: str) -> None:
    print()
    for i, t in enumerate(turns, 1):
        u = t["usage"]
        reused = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        vs = f" ({t['ttft'] / turns[0]['ttft']:.2f}x turn 1)" if i > 1 else ""
        label = "conversation" if i == 1 else ""
        print(f"{label:<14}turn {i}: {u.get('prompt_tokens')} prompt tokens, {reused or 'none'} reused from the cache, "
              f"first token after {t['ttft']:.2f} s{vs}")
    print(f"{'MTP':<14}{mtp_line(status['plugins']['mtp-routing']['mtp'])}")
    turn_paths = " / ".join(routes[:2]) or "?"
    print(f"{'routing':<14}turns 1 and 2: {turn_paths} | the image request: {routes[2] if len(routes) > 2 else '?'}")
    print(f"{'replies':<14}turn 1 {turns[0]['text'][:40]!r} | image {image['text'][:30]!r}")
    print(f"{'full status':<14}saved to {STATUS_FILE} (GET {url}/v1/status while a server runs; docs/status.md)")


def mtp_line(mtp: dict[str, Any]) -> str:
    if not mtp.get("enabled"):
        return f"off: {mtp.get('reason', 'not requested')}"
    drafted, accepted = mtp.get("drafted", 0), mtp.get("accepted", 0)
    if not drafted:
        return "on, no drafts yet (the adaptive schedule measures before it drafts)"
    per_step = 1 + mtp.get("k", 1) * accepted / drafted  # tokens a row gains per drafting step
    return (f"acceptance {accepted / drafted:.2f} ({accepted} of {drafted} drafts): {per_step:.2f} tokens per row per "
            f"drafting step; {mtp.get('steps_with_mtp', 0)} drafting steps, {mtp.get('steps_without_mtp', 0)} plain")


if __name__ == "__main__":
    raise SystemExit(main())
