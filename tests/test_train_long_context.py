"""training/train_long_context.py: the curriculum's phases, their logged step counts, and the saved pair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import train_long_context as L  # noqa: E402


def test_curriculum_parses_and_normalises_shares() -> None:
    assert L.parse_curriculum("512x32:0.5,4096x4:1.5") == [(512, 32, 0.25, None), (4096, 4, 0.75, None)]
    assert L.parse_curriculum("256x8") == [(256, 8, 1.0, None)]
    assert L.parse_curriculum("256x64@80:1,512x8:3") == [(256, 64, 0.25, 80.0), (512, 8, 0.75, None)]
    for bad in ("512:0.5", "32x4:1", "512x0:1", "512x4:0", "256x8@0:1", "256x8@x:1"):
        with pytest.raises(SystemExit, match="--curriculum"):
            L.parse_curriculum(bad)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A corpus.npz of random token ids (train and held-out parts)."""
    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(0)
    np.savez(d / "corpus.npz", train=rng.integers(300, 3000, 20_000).astype(np.uint16),
             heldout=rng.integers(300, 3000, 5_000).astype(np.uint16))
    return d


def test_fixed_steps_per_phase_train_log_and_load(tmp_path: Path, data: Path) -> None:
    out = tmp_path / "run"
    L.main(["train", "--data", str(data), "--out", str(out), "--shape", "tiny", "--curriculum", "64x2@500:0.3,64x2:0.3,128x1:0.4",
            "--steps", "1,2,1", "--pairs-per-k", "32,48", "--eval-windows", "1", "--no-compile"])
    log = json.loads((out / "train_log.json").read_text())
    assert log["phase_steps"] == [1, 2, 1] and log["reproduce"] == "--steps 1,2,1"
    assert log["tokens_seen"] == 64 * 2 + 2 * 64 * 2 + 128
    assert set(log["eval"]) == {"target", "draft"}
    target = L.load_model(out / "target")
    assert len(target.model.layers) == 4
    with pytest.raises(SystemExit, match="one count per curriculum phase"):
        L.main(["train", "--data", str(data), "--out", str(out), "--curriculum", "64x2", "--steps", "1,1"])


def test_a_dense_phase_fills_its_windows_with_pairs() -> None:
    from retrieval_task import load_task

    task = load_task(L.TOKENIZER, "train")
    corpus = np.random.default_rng(0).integers(300, 3000, 5_000).astype(np.int32)
    x, m = next(L.batches(task, corpus, 2, 256, (80.0, 80.0), np.random.default_rng(1)))
    pairs = 256 // (task.def_len + task.query_len)
    assert x.shape == (2, 257) and m.sum(axis=1).tolist() == [2 * pairs, 2 * pairs]  # two answer tokens a pair


def test_tied_target_only_run_saves_and_loads(tmp_path: Path, data: Path) -> None:
    out = tmp_path / "run"
    L.main(["train", "--data", str(data), "--out", str(out), "--shape", "proof", "--curriculum", "64x2@80:1", "--steps", "1",
            "--tie", "--target-only", "--value-pool", "16", "--eval-windows", "1", "--no-compile"])
    log = json.loads((out / "train_log.json").read_text())
    assert set(log["eval"]) == {"target"} and not (out / "draft").exists()
    assert {"answer_token_acc_teacher_forced", "fresh_pairs_answer_token_acc_teacher_forced"} <= set(log["eval"]["target"])
    cfg = json.loads((out / "target" / "text_config.json").read_text())
    assert cfg["tie_word_embeddings"]
    target = L.load_model(out / "target")
    assert "lm_head" not in target


def test_a_value_pool_is_a_fixed_draw_of_the_training_values() -> None:
    from retrieval_task import load_task

    full, pool = load_task(L.TOKENIZER, "train"), load_task(L.TOKENIZER, "train", value_pool=32)
    again = load_task(L.TOKENIZER, "train", value_pool=32)
    assert len(pool.values) == 32 and set(pool.values) <= set(full.values)
    assert pool.values.tolist() == again.values.tolist() and pool.keys.tolist() == full.keys.tolist()
