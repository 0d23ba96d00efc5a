"""training/: the chunked gated delta rule, a tiny training run, and the committed trained checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import train_tiny_qwen35 as T  # noqa: E402
from chunked_gated_delta import gated_delta_chunked, patch_mlx_lm_qwen3_5  # noqa: E402
from mlx_lm.models.gated_delta import gated_delta_update  # noqa: E402

TRAINED = REPO / "models" / "tiny-qwen35-trained"


def _inputs(seed: int, T_: int, correlated: bool):
    mx.random.seed(seed)
    B, Hk, Hv, Dk, Dv = 2, 2, 4, 16, 8
    q = mx.random.normal((B, T_, Hk, Dk)) / Dk
    k = mx.random.normal((B, T_, Hk, Dk))
    if correlated:  # nearly repeated keys: the hard case for a triangular solve
        k = 0.05 * k + mx.random.normal((1, 1, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T_, Hv, Dv))
    a = mx.random.normal((B, T_, Hv)) - 2
    b = mx.random.normal((B, T_, Hv)) + 2
    A_log = mx.log(mx.random.uniform(0.01, 4.0, (Hv,)))
    return q, k, v, a, b, A_log, -mx.ones((Hv,))


def _rel(x: mx.array, y: mx.array) -> float:
    return (mx.linalg.norm((x - y).reshape(-1)) / mx.linalg.norm(y.reshape(-1))).item()


@pytest.mark.parametrize("T_,correlated,with_state", [(37, False, False), (48, True, True), (5, True, False)])
def test_chunked_matches_mlx_lm_recurrence(T_: int, correlated: bool, with_state: bool) -> None:
    args = _inputs(T_, T_, correlated)
    state = mx.random.normal((2, 4, 8, 16)) if with_state else None
    y_ref, s_ref = gated_delta_update(*args, state=state, use_kernel=False)
    y, s = gated_delta_chunked(*args, state=state, chunk=16)
    assert _rel(y, y_ref) < 1e-4 and _rel(s, s_ref) < 1e-4


def test_chunked_gradients_match() -> None:
    q, k, v, a, b, A_log, dt = _inputs(3, 40, True)

    def loss(fn):
        return lambda v_, b_: (fn(q, k, v_, a, b_, A_log, dt)[0] ** 2).sum()

    ref = mx.grad(loss(lambda *x: gated_delta_update(*x, use_kernel=False)), argnums=(0, 1))(v, b)
    got = mx.grad(loss(gated_delta_chunked), argnums=(0, 1))(v, b)
    for g, r in zip(got, ref):
        assert _rel(g, r) < 1e-4  # fp32, nearly repeated keys: some cancellation


def test_patch_routes_and_undoes() -> None:
    from mlx_lm.models import qwen3_5

    original = qwen3_5.gated_delta_update
    undo = patch_mlx_lm_qwen3_5(16)
    try:
        assert qwen3_5.gated_delta_update is not original
    finally:
        undo()
    assert qwen3_5.gated_delta_update is original


def test_heldout_split_is_stable_and_excludes_tests() -> None:
    assert not T.is_heldout("test/test_os.py")
    picked = [p for p in (f"pkg/mod{i}.py" for i in range(400)) if T.is_heldout(p)]
    assert 20 < len(picked) < 60  # about one in ten
    assert picked == [p for p in (f"pkg/mod{i}.py" for i in range(400)) if T.is_heldout(p)]


def test_tiny_training_run_lowers_loss_and_saves(tmp_path: Path) -> None:
    """A few steps at a toy size: losses fall, shards round-trip, the MTP head has host names."""
    cfg = {**json.loads((TRAINED / "config.json").read_text())["text_config"]} if TRAINED.exists() else None
    if cfg is None:
        pytest.skip("models/tiny-qwen35-trained not present")
    cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=16,
               linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=64)
    data = tmp_path / "data"
    data.mkdir()
    (data / "text_config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 64, 16)
    np.savez(data / "corpus.npz", train=np.tile(pattern, 200).astype(np.uint16),
             heldout=np.tile(pattern, 20).astype(np.uint16))
    out = tmp_path / "run"
    T.main(["train", "--data", str(data), "--out", str(out), "--steps", "30", "--batch", "4", "--seq", "16",
            "--lr", "3e-3", "--warmup", "3", "--log-every", "10", "--eval-windows", "4",
            "--no-compile"])  # compiling the step costs ~50 s of C++ builds on a cold CPU cache
    log = json.loads((out / "train_log.json").read_text())
    assert log["log"][-1]["main_ce"] < log["log"][0]["main_ce"]
    w = T.load_trained(out)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.norm.weight", "lm.lm_head.weight"} <= set(w)
    assert w["mtp.fc.weight"].shape == (32, 64)


@pytest.mark.skipif(not TRAINED.exists(), reason="models/tiny-qwen35-trained not present")
def test_committed_checkpoint_serves_with_trained_mtp() -> None:
    """mlx_vlm.load + build_text_model + inject_mtp_support on the committed checkpoint: the MTP head
    agrees with the backbone on a held-out-style code snippet far above chance."""
    import eval_tiny_qwen35 as E
    from tokenizers import Tokenizer

    size = sum(f.stat().st_size for f in TRAINED.rglob("*") if f.is_file())
    assert size <= 30 * 2**20
    manifest = json.loads((TRAINED / "mtp" / "manifest.json").read_text())
    assert manifest["rmsnorm_weight_format"] == "mlx_gamma"
    _, tm = E.load_served(TRAINED)
    tok = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
    text = (Path(json.__file__).parent / "decoder.py").read_text()  # any stdlib code
    ids = np.asarray(tok.encode(text).ids[:513], dtype=np.int32)
    tf = E.teacher_forced(tm, ids, seq=256, windows=2, batch=2)
    assert tf["ppl"] < 60
    assert tf["mtp_agreement"] > 0.5
