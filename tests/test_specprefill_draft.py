"""The SpecPrefill draft (training --shape draft, models/tiny-qwen35-draft) and the SpecPrefill benchmarks' logic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))
sys.path.insert(0, str(REPO / "benchmarks"))

import specprefill_quality as Q  # noqa: E402
import specprefill_speed as S  # noqa: E402
import train_tiny_qwen35 as T  # noqa: E402

TRAINED = REPO / "models" / "tiny-qwen35-trained"
DRAFT = REPO / "models" / "tiny-qwen35-draft"


def test_draft_shape_trains_assembles_and_scores(tmp_path: Path) -> None:
    """A toy draft-shaped run (no MTP head) through train and assemble: the loss falls, nothing named mtp.*
    is trained or written, and the checkpoint loads with mlx_lm and is accepted by SpecPrefill's scoring."""
    from mlx_lm import load

    from support.tiny_model import build_tiny_qwen35_vlm
    from vllm_mlx_mtp_routing.specprefill import score_tokens

    shape = {**T.DRAFT_SHAPE, "hidden_size": 32, "intermediate_size": 64, "head_dim": 16, "linear_head_dim": 16}
    data = tmp_path / "data"
    build_tiny_qwen35_vlm(data / "skeleton", tokenizer_from=TRAINED, **T.builder_kwargs(shape))
    (data / "shape.json").write_text(json.dumps(shape))
    cfg = json.loads((data / "skeleton" / "config.json").read_text())["text_config"]
    (data / "text_config.json").write_text(json.dumps(cfg))
    pattern = np.random.default_rng(0).integers(0, 4000, 24)
    np.savez(data / "corpus.npz", train=np.tile(pattern, 100).astype(np.uint16), heldout=np.tile(pattern, 10).astype(np.uint16))
    run = tmp_path / "run"
    T.main(["train", "--data", str(data), "--out", str(run), "--steps", "30", "--batch", "4", "--seq", "32", "--lr", "1e-2",
            "--warmup", "3", "--log-every", "10", "--eval-windows", "2", "--gdn-chunk", "0", "--no-compile"])
    log = json.loads((run / "train_log.json").read_text())
    assert log["log"][-1]["main_ce"] < log["log"][0]["main_ce"] - 1.0
    assert not any(k.startswith("mtp.") for k in T.load_trained(run))
    out = tmp_path / "draft"
    T.main(["assemble", "--data", str(data), "--weights", str(run), "--out", str(out)])
    assert not (out / "mtp").exists()
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
    draft = load(str(out))[0]
    prompt = np.tile(pattern, 8).tolist()[:150]
    kept = score_tokens(draft, prompt, 0.3)
    assert kept[-1] == len(prompt) - 2 and 0.3 * 149 <= len(kept) < 149


@pytest.mark.skipif(not DRAFT.exists(), reason="models/tiny-qwen35-draft not present")
def test_committed_draft_fits_and_shares_the_tokenizer() -> None:
    """<= 5 MB, the trained model's tokenizer byte for byte, 2 layers with one full-attention layer to score with,
    and a language model: far better than chance on stdlib code it never saw in training."""
    from mlx_lm import load

    from vllm_mlx_mtp_routing.specprefill.scoring import attention_layers

    assert sum(f.stat().st_size for f in DRAFT.rglob("*") if f.is_file()) <= 5 * 2**20
    assert (DRAFT / "tokenizer.json").read_bytes() == (TRAINED / "tokenizer.json").read_bytes()
    draft = load(str(DRAFT))[0]
    assert attention_layers(draft) == [1]
    import eval_perplexity as E
    from eval_tiny_qwen35 import heldout_tokens

    ids = heldout_tokens(DRAFT, Path(__import__("sysconfig").get_paths()["stdlib"]), limit=4 * 257 + 1)
    # 884 in bf16 on these 1024 tokens; the builder's random init of the same shape: 5.9e6 (uniform: 4096)
    assert E.perplexity(draft, ids, seq=256, windows=4, batch=4)["ppl"] < 2000


def test_call_sites_need_the_early_definition() -> None:
    """A call qualifies when its function was defined far enough back and is not named in the recent window."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TRAINED))
    filler = "".join(f"x{i} = {i} * 2  # filler line {i}\n" for i in range(120))
    src = "def helper(a, b):\n    return a + b\n\n" + filler + "total = helper(x1, x2)\n" + filler + "again = helper(3, 4)\n"
    sites = Q.file_call_sites(src, "m.py", tok, min_distance=200, recent=100, min_prompt=300, max_prompt=4000)
    assert [(s.name, s.call_line) for s in sites] == [("helper", "helper(x1, x2)")]
    s = sites[0]
    assert tok.decode(s.prompt_ids).rstrip().endswith("total =")
    assert "def helper" in tok.decode(s.prompt_ids[s.def_span[0] : s.def_span[1]])
    assert Q.task_scores(s, s.lead + "helper(x1, x2)\n") == {"name": True, "call": True}
    assert Q.task_scores(s, s.lead + "helper(x2)") == {"name": True, "call": False}
    assert Q.task_scores(s, s.lead + "helpers(x1)") == {"name": False, "call": False}
    attr = (
        "class A:\n    def helper(self):\n        return 1\n\n" + filler.replace("x", "    x") + "    def run(self):\n        return self.helper()\n"
    )
    (a_site,) = Q.file_call_sites(attr, "m.py", tok, min_distance=200, recent=100, min_prompt=300, max_prompt=4000)
    assert Q.task_scores(a_site, a_site.lead + "helper()\n") == {"name": True, "call": True}
    # named again inside the recent window: the early context is not needed, no site
    near = "def helper(a, b):\n    return a + b\n\n" + filler + "helper\n" + "total = helper(x1, x2)\n"
    assert Q.file_call_sites(near, "m.py", tok, min_distance=200, recent=100, min_prompt=300, max_prompt=4000) == []
    # too close to the definition
    assert Q.file_call_sites(src, "m.py", tok, min_distance=5000, recent=100, min_prompt=300, max_prompt=8000) == []


def test_speed_smoke_reports_every_point(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    S.main(["--smoke", "--lengths", "160", "--keep", "0.25", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["skipped"] == [] and {p["draft"] for p in rep["points"]} == {"small-draft", "small-attn"}
    for p in rep["points"]:
        assert p["tokens"] == 160 and 0.25 * 159 <= p["kept"] < 159
        assert p["ideal"] == pytest.approx(1 / (0.25 + p["draft_scoring_s"] / p["dense_ttft_s"]), rel=1e-2)
        assert p["efficiency"] == pytest.approx(p["speedup"] / p["ideal"], rel=1e-2)
    assert rep["versions"]["mlx"] == mx.__version__


def test_speed_budget_skips_what_does_not_fit(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    S.main(["--smoke", "--lengths", "128,4096", "--keep", "0.3", "--warmup", "0", "--budget-s", "0.01", "--out", str(out)])
    rep = json.loads(out.read_text())
    # the first length's dense run has no estimate yet and runs; nothing else fits a 10 ms budget
    assert rep["points"] == []
    assert {(s["tokens"], s["what"]) for s in rep["skipped"]} == {(128, "small-draft"), (128, "small-attn"), (4096, "all")}
