"""The tiny Qwen3.5-MoE VLM (conftest `moe_vlm_factory`: the trained model made MoE, MoE layers in its MTP head too)
served through the plugin on the real server, fp32 (MLX's CPU GatherMM is float32-only) and bf16.

One server per checkpoint: the raw HF checkpoint with fused experts (MTP drafting every step), the one with
per-expert tensors (MTP too) and the MLX layout without MTP must give the same greedy text; on the first, requests
sent together equal each alone, the head's drafts are accepted, a shared prefix hits the cache and images take the
media path. The bf16 checkpoint serves text and images with its experts in float32 and says so once at start-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.server import Server, png_data_url, serve

pytestmark = [pytest.mark.server, pytest.mark.slow]

FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4",
         "--prefill-step-size", "64", "--prefill-stall-ratio", "0")
MTP = ("--enable-mtp", "--mtp-schedule", "always")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main(argv=None):\n    parser = ",
           "class Stack:\n    def __init__(self):", "for i in range(10):"]
MAX_TOKENS = 24
SYSTEM = ("You are a careful assistant for a software team. Answer briefly, cite files by path, never invent APIs, "
          "and ask before running anything that writes to disk. ") * 3


def _chat(server: Server, content: object, **extra: object) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    r = server.post("/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(server: Server) -> list[str]:
    return [_chat(server, p)["choices"][0]["message"]["content"] for p in PROMPTS]


def _status(server: Server) -> dict:
    return server.get("/v1/status").json()["plugins"]["mtp-routing"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-e2e")


@pytest.fixture(scope="module")
def fused(moe_vlm_factory: Callable[..., Path], logs: Path) -> Iterator[Server]:
    with serve(moe_vlm_factory("fused"), *FLAGS, *MTP, log_dir=logs) as server:
        yield server


@pytest.fixture(scope="module")
def alone(fused: Server) -> list[str]:
    return _greedy(fused)


def test_fused_experts_draft_and_batched_equals_alone(fused: Server, alone: list[str]) -> None:
    built = [ln for ln in fused.log().splitlines() if "TextModel built zero-copy" in ln]
    assert len(built) == 1 and "MTP head" in built[0] and "raw HF checkpoint" in built[0], built
    status = _status(fused)
    assert status["routing"]["text"] >= len(PROMPTS) and status["routing"]["fallback"] == 0
    mtp = status["mtp"]
    # the head's MoE layer drafts what the backbone then accepts, and not always: both paths ran
    assert 0 < mtp["accepted"] < mtp["drafted"] and mtp["acceptance_rate"] > 0.3, mtp

    async def burst() -> list[str]:
        client = fused.async_openai(timeout=300)

        async def one(i: int, p: str) -> str:
            await asyncio.sleep(0.05 * i)  # arrive at different steps
            out = await client.chat.completions.create(model=fused.model, messages=[{"role": "user", "content": p}],
                                                       max_tokens=MAX_TOKENS, temperature=0)
            return out.choices[0].message.content or ""

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(burst()) == alone


def test_shared_prefix_hits_the_cache(fused: Server) -> None:
    usage = []
    for question in ("Where is the config parser?", "List the tests please."):
        body = {"model": fused.model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
        r = fused.post("/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        usage.append((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert usage[0] == 0 and usage[1] > 50, usage


def test_images_take_the_media_path(fused: Server) -> None:
    before = _status(fused)["routing"]["media"]
    texts = []
    for rgb in ((0, 0, 0), (255, 255, 255)):
        content = [{"type": "text", "text": "Describe the picture."}, {"type": "image_url", "image_url": {"url": png_data_url(rgb)}}]
        choice = _chat(fused, content, logprobs=True)["choices"][0]
        texts.append((choice["message"]["content"], [e["logprob"] for e in choice["logprobs"]["content"]]))
    assert texts[0] != texts[1]  # the pixels reach the model (its greedy text may agree: then its probabilities don't)
    assert _status(fused)["routing"]["media"] == before + 2


def test_per_expert_and_mlx_layouts_without_mtp_give_the_same_text(moe_vlm_factory: Callable[..., Path], logs: Path,
                                                                   alone: list[str]) -> None:
    with serve(moe_vlm_factory("per-expert"), *FLAGS, *MTP, log_dir=logs) as server:
        assert _greedy(server) == alone
        assert _status(server)["mtp"]["accepted"] > 0
    with serve(moe_vlm_factory("mlx"), *FLAGS, log_dir=logs) as server:
        assert _greedy(server) == alone
        assert _status(server)["mtp"] == {"enabled": False}


def test_bf16_moe_serves_on_the_cpu(moe_vlm_factory: Callable[..., Path], logs: Path) -> None:
    """MLX's CPU GatherMM is float32-only: the host alone fails each request on this checkpoint; with the plugin its
    experts multiply in float32, said in one line at start-up, and text and images are served."""
    with serve(moe_vlm_factory("mlx", "bfloat16"), *FLAGS, *MTP, log_dir=logs) as server:
        text = _chat(server, PROMPTS[0])
        content = [{"type": "text", "text": "Describe the picture."}, {"type": "image_url", "image_url": {"url": png_data_url((0, 0, 0))}}]
        image = _chat(server, content)
        status = _status(server)
        log = server.log()
    assert text["usage"]["completion_tokens"] == MAX_TOKENS and image["choices"][0]["message"]["content"]
    assert status["routing"]["text"] == 1 and status["routing"]["media"] == 1 and status["mtp"]["accepted"] > 0
    lines = [ln for ln in log.splitlines() if "GatherMM" in ln]
    assert len(lines) == 1 and lines[0].startswith("WARNING") and "bfloat16" in lines[0], lines
    assert "Traceback" not in log
