"""MTP on the text path through the real server, with the trained tiny model (its head really accepts)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from support.server import Server, serve

pytestmark = pytest.mark.server

TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
# test_logits_processing_e2e's flags: its servers with and without MTP are this module's too (shared_server)
FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "32")
# every step drafting, and the head over only the prompts' last 4 positions: the prefill's first chunk runs without
# it, the head starts at a later position (and must keep the output exact)
MTP_ALWAYS = ("--enable-mtp", "--mtp-schedule", "always", "--mtp-prompt-pairs", "4")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main(argv=None):\n    parser = ", "class Stack:\n    def __init__(self):"]


def greedy(server: Server) -> list[str]:
    outs = []
    for prompt in PROMPTS:
        body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
        outs.append(server.post("/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"])
    return outs


def test_mtp_output_equals_plain_and_drafts_are_accepted(tmp_path: Path, shared_server: Callable[..., Server]) -> None:
    with serve(TRAINED, *FLAGS, "--enable-mtp", log_dir=tmp_path) as server:
        with_mtp = greedy(server)
        status = server.get("/v1/status").json()
        mtp = status["plugins"]["mtp-routing"]["mtp"]
        # the host's own status block tells the same story: MTP runs on the text path
        assert status["mtp"]["path"] == "text" and status["mtp"]["drafted"] == mtp["drafted"]
        assert mtp["enabled"] is True and status["mtp"]["enabled"] is True  # every mtp block says whether MTP runs
    server = shared_server(TRAINED, *FLAGS, *MTP_ALWAYS)
    before = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    always = greedy(server)
    after = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    fixed = {k: after[k] - before[k] for k in ("drafted", "accepted", "steps_with_mtp", "steps_without_mtp")}  # a shared server
    assert "head over the prompt's last 4 positions" in server.log()
    server = shared_server(TRAINED, *FLAGS)
    without = greedy(server)
    assert server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"] == {"enabled": False}
    assert with_mtp == without == always
    assert after["adaptive"] is False and fixed["steps_with_mtp"] > fixed["steps_without_mtp"]
    assert fixed["accepted"] > 0.5 * fixed["drafted"]  # the trained head (0.87 held-out) really drafts
    # adaptive MTP drafts at least while it measures what drafting costs at each batch size
    assert mtp["drafted"] > 0 and mtp["steps_with_mtp"] > 0
    assert mtp["accepted"] > 0
    assert set(mtp) >= {"drafted", "accepted", "acceptance_rate", "steps_with_mtp", "steps_without_mtp"}


# Its next token at temperature 1, top-k 2: p = (0.51, 0.49) on "as" and "te" (a direct forward of the checkpoint), where
# the trained head drafts "as" with q = 0.89 and "key", outside p's support, with 0.11 (the head's q as the engine
# drafts it, --mtp-prompt-pairs 4). A draft "as" is kept with probability p/q = 0.57; a rejection resamples from
# (p - q)+, "te" alone.
SAMPLED_PROMPT = "return self."
SAMPLED_ROWS = 128  # 8 requests of n = 16: seeds 0..127


def _first_token_distribution(prompt: str, top_k: int) -> dict[str, float]:
    """The first generated token's distribution at temperature 1 and this top-k, by a direct forward of the
    checkpoint without its head: {token text: p}."""
    import mlx.core as mx
    from mlx_vlm import load
    from vllm_mlx.text_model_from_vlm import build_text_model

    vlm, processor = load(str(TRAINED))
    model, tok = build_text_model(vlm, TRAINED, enable_mtp=False), processor.tokenizer
    logits = model(mx.array([tok.encode(prompt, add_special_tokens=False)]))[0, -1].astype(mx.float32)
    top = mx.argsort(-logits)[:top_k]
    return dict(zip((tok.decode([t]) for t in top.tolist()), mx.softmax(logits[top]).tolist()))


def test_sampling_with_the_heads_drafts_keeps_the_target_distribution(shared_server: Callable[..., Server]) -> None:
    """Speculative sampling through the server leaves the first token distributed as p: 128 seeded rows, each
    drafting it with the trained head (q != p), against a direct forward; no token outside p's support, chi-square
    p-value > 1e-3 (1 degree of freedom).

    Power: resampling a rejection from p instead of (p - q)+ puts 0.76 on "as" and fails the test with probability
    0.997 (128 rows); taking q from the head's raw logits instead of its processed distribution puts ~0.95 there;
    accepting every draft, or with probability min(1, q/p), samples "key" in 11% of the rows (none in 128: 2e-7).
    These fixed seeds pass with the correct sampler (65 expected on "as") and fail with each of those bugs."""
    server = shared_server(TRAINED, *FLAGS, *MTP_ALWAYS)
    p = _first_token_distribution(SAMPLED_PROMPT, 2)
    assert len(p) == 2 and min(p.values()) > 0.4
    before = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    firsts: list[str] = []
    for seed in range(0, SAMPLED_ROWS, 16):  # copy j of a request samples with seed + j (host/choices.py)
        body = {"model": server.model, "prompt": SAMPLED_PROMPT, "max_tokens": 2, "temperature": 1.0, "top_p": 1.0,
                "top_k": 2, "min_p": 0.0, "n": 16, "seed": seed, "logprobs": 0}
        r = server.post("/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        firsts += [c["logprobs"]["tokens"][0] for c in r.json()["choices"]]
    after = server.get("/v1/status").json()["plugins"]["mtp-routing"]["mtp"]
    assert set(firsts) <= set(p), sorted(set(firsts) - set(p))  # the support
    stat = sum((firsts.count(t) - SAMPLED_ROWS * pt) ** 2 / (SAMPLED_ROWS * pt) for t, pt in p.items())
    assert math.erfc(math.sqrt(stat / 2)) > 1e-3, ({t: firsts.count(t) for t in p}, p)
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]  # a shared server
    assert drafted == SAMPLED_ROWS and 0 < accepted < drafted  # every row drafted its first token; kept and rejected
