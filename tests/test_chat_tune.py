"""training/: the chat fine-tune's samples, a toy run of it, its assembly, and its evaluation's prompts."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import chat_samples as S  # noqa: E402
import chat_tune_tiny_qwen35 as C  # noqa: E402
import eval_chat_tiny_qwen35 as E  # noqa: E402

TRAINED = REPO / "models" / "tiny-qwen35-trained"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TRAINED))


@pytest.fixture(scope="module")
def sources():
    return S.load_sources(STDLIB, heldout=True, max_files=60)


def test_samples_end_with_a_blank_line_and_im_end(tokenizer, sources) -> None:
    rng = np.random.default_rng(0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for _ in range(20):
        s = S.build_sample(rng, tokenizer, sources)
        prompt, reply = tokenizer.decode(s.prompt), tokenizer.decode(s.reply[:-1])
        assert s.reply[-1] == im_end and im_end not in s.reply[:-1]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n" if s.enable_thinking else "</think>\n\n")
        code = reply.removeprefix("\n</think>\n\n") if s.enable_thinking else reply
        assert code.endswith("\n\n") and "\n\n" not in code[:-2]
        assert 2 <= len(code[:-2].split("\n")) <= S.REPLY_LINES


def test_long_agent_prompt_reaches_its_size(tokenizer, sources) -> None:
    replay = next(r for r in E.replay_requests() if r["name"] == "claude-code-1")
    msgs, tools = S.long_agent_messages(np.random.default_rng(1), sources, tokenizer, 3000, replay=replay)
    text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= 3000
    assert replay["user"] in text and tools[: len(replay["tools"])] == replay["tools"]


def test_replays_render_with_the_template(tokenizer) -> None:
    reqs = E.replay_requests()
    assert {r["name"].rsplit("-", 1)[0] for r in reqs} == {"qwen-code", "opencode", "claude-code", "codex"}
    for r in reqs:
        assert [m["role"] for m in r["messages"]].count("system") <= 1
        text = tokenizer.apply_chat_template(r["messages"], tools=r["tools"] or None, add_generation_prompt=True,
                                             tokenize=False)
        assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_toy_chat_tune_assembles_and_decodes(tmp_path: Path) -> None:
    """Two steps on a toy checkpoint with the trained model's tokenizer: the tuned weights replace the base's,
    the declared context is set, and the result serves through the evaluation's loader."""
    from support.tiny_model import build_tiny_qwen35_vlm

    base = tmp_path / "base"
    build_tiny_qwen35_vlm(base, dtype="bfloat16", hidden_size=32, intermediate_size=64, head_dim=16,
                          linear_head_dim=8, tokenizer_from=TRAINED)
    run = tmp_path / "run"
    C.main(["train", "--base", str(base), "--out", str(run), "--steps", "2", "--batch", "2", "--seq", "32",
            "--chat-batch", "1", "--chat-seq", "512", "--long-every", "0", "--corpus-files", "5", "--log-every", "1"])
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.gated_delta import gated_delta_update

    assert qwen3_5.gated_delta_update is gated_delta_update  # the training's chunked rule is undone
    log = json.loads((run / "train_log.json").read_text())
    assert log["steps"] == 2 and log["log"][0]["reply_ce"] > 0
    out = tmp_path / "tuned"
    C.main(["assemble", "--base", str(base), "--weights", str(run), "--out", str(out)])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["max_position_embeddings"] == C.QWEN35_CONTEXT
    import mlx.core as mx

    before, after = mx.load(str(base / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    name = "language_model.model.embed_tokens.weight"
    assert after[name].dtype == before[name].dtype and not mx.array_equal(after[name], before[name]).item()
    _, tm = E.load_served(out)
    reply = E.greedy_reply(tm, list(range(10, 40)), max_new=5, stop={4002}, chunk=16)
    assert 1 <= len(reply) <= 5
