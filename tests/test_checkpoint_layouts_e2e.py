"""Quantized conversions of the trained model, every MTP layout, through the real server.

Every layout x {bf16, 8-bit, 4-bit} cell is served (`--enable-mtp --plugins mtp-routing`), one server per
cell doing all of its checks: the head loads from where the layout keeps it (start-up log), greedy output
equals the same conversion served without MTP, drafting runs with drafts both accepted and rejected, and text
requests stay on the text path. The baseline per precision is the conversion without MTP weights, served with
`--enable-mtp`: it also checks the no-MTP start-up line and status. 16 servers, one completion of 8 tokens from an
8-token prompt each: MLX's CPU backend runs a quantized matmul row by row (~60 ms a prompt token and ~100 ms a
drafting step at 4 bits here, ~3x bf16), so every token counts; the chat template's 13 tokens would cost more than
the 8 generated. The mixed-precision conversion and the head-vs-mlx-vlm tensor checks run at the engine level
(tests/test_checkpoint_layouts.py). The trained model (not a random one) makes acceptance meaningful: a head
loaded with the wrong RMSNorm convention or quantization would draft but hardly ever be accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.checkpoint_variants import Variant, variant
from support.server import Server, serve
from vllm_mlx_mtp_routing.model.checkpoint_layouts import NO_MTP_HINT

pytestmark = [pytest.mark.server, pytest.mark.slow]

TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
# No prefill-stall calibration: these servers test loading, and a quantized model prefills ~15x slower than bf16 on
# MLX's CPU backend, so the calibration would dominate each server's start.
FLAGS = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--enable-mtp", "--prefill-stall-ratio", "0")
# 8 prompt tokens; every conversion drafts 4 times in the 8 tokens after them (3 accepted, 1 rejected)
PROMPTS = ["def __init__(self, name):\n"]
MAX_TOKENS = 8
PRECISIONS = ("bf16", "8bit", "4bit")
LAYOUT_SOURCE = {"subdir": "mtp/weights.safetensors", "model-mtp": "model-mtp.safetensors", "mtp-file": "mtp.safetensors",
                 "main": "safetensors", "drafter": "the host's --mllm-draft-model"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trained_variants")


def _mtp_status(server: Server) -> dict:
    return server.get("/v1/status").json()["plugins"]["mtp-routing"]


def _greedy(server: Server, **extra: object) -> list[str]:
    outs = []
    for prompt in PROMPTS:
        body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
        r = server.post("/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS  # no early stop: every cell drafts as long
        outs.append(r.json()["choices"][0]["text"])
    return outs


@pytest.fixture(scope="module")
def plain_outputs(work: Path) -> Iterator[dict[str, list[str]]]:
    """Per precision: the conversion without MTP weights, served with --enable-mtp; its greedy outputs."""
    class Lazy(dict):
        def __missing__(self, precision: str) -> list[str]:
            v = variant(work, TRAINED, "none", precision)
            with serve(v.model, *FLAGS, log_dir=work) as server:
                outs = _greedy(server)
                status = _mtp_status(server)
                log = server.log()
            # It starts, serves, and says why there is no MTP and how to get it: one line, and the status.
            assert status["text_path"] is True and status["routing"]["text"] == len(PROMPTS)
            assert status["mtp"] == {"enabled": False, "reason": "no MTP weights in the checkpoint", "how_to_enable": NO_MTP_HINT}
            lines = [ln for ln in log.splitlines() if "serves without MTP" in ln]
            assert len(lines) == 1 and "no MTP weights in the checkpoint" in lines[0] and "mlx_vlm.convert" in lines[0]
            self[precision] = outs
            return outs

    yield Lazy()


# mlx-lm's proposed --preserve-mtp file (mtp.safetensors) is not released: one cell here, all at the engine level.
CELLS = [(layout, precision) for layout in ("subdir", "model-mtp", "main", "drafter") for precision in PRECISIONS]
CELLS.append(("mtp-file", "8bit"))


@pytest.mark.parametrize(("layout", "precision"), CELLS)
def test_served_head_drafts_and_output_equals_plain(work: Path, plain_outputs, layout: str, precision: str) -> None:
    v: Variant = variant(work, TRAINED, layout, precision)
    with serve(v.model, *FLAGS, "--mtp-schedule", "always", *v.serve_flags(), log_dir=work) as server:
        # mllm_draft asks for the host's drafter: the text path has one, so it serves the request there
        outs = _greedy(server, mllm_draft=True) if layout == "drafter" else _greedy(server)
        status = _mtp_status(server)
        log = server.log()
    built = [ln for ln in log.splitlines() if "TextModel built zero-copy" in ln]
    assert len(built) == 1 and "MTP head" in built[0] and LAYOUT_SOURCE[layout] in built[0], built
    assert status["routing"] == {"enabled": True, "text": len(PROMPTS), "media": 0, "fallback": 0}
    mtp = status["mtp"]
    assert 0 < mtp["accepted"] < mtp["drafted"], mtp  # both the accept and the reject paths ran
    assert outs == plain_outputs[precision]
    # the trained head keeps drafting usefully after conversion (a mis-loaded head gets ~0)
    assert mtp["acceptance_rate"] > 0.3, mtp
