#!/usr/bin/env python3
"""Train a tiny Qwen3.5 VLM's language model and MTP head on Python's standard library.

Three steps, each reproducible (fixed seeds, files picked by a hash of their path):

  prepare   (CPU, needs the project installed): build the model skeleton (config, tokenizer, processor
            configs, random vision tower) with the project's builder, tokenize the stdlib (train and
            held-out files, split by path hash) and write corpus.npz next to it.
  train     (any MLX device; the GPU run used MLX's CUDA backend): train the mlx-lm qwen3_5 TextModel
            and a Qwen3.5 MTP head jointly, write trained-NN.safetensors + train_log.json.
  assemble  (CPU): write the servable checkpoint: skeleton + trained weights in the VLM layout,
            MTP head in mtp/weights.safetensors with an mlx_gamma manifest, bf16.

The MTP head follows Qwen3.5's contract as the host runs it (vllm_mlx 0.6.0
patches/qwen3_5_mtp.py, mlx-vlm 0.7.10 speculative/drafters/qwen3_5_mtp): for position t,
x = fc(concat([pre_fc_norm_embedding(embed(tok[t+1])), pre_fc_norm_hidden(h[t])])), where h is the
backbone's hidden state AFTER the final norm ("post_norm"); x runs through one full-attention
decoder layer (causal, RoPE positions 0..T-2 like the drafter's prefill), then mtp.norm and the
shared lm_head predict tok[t+2]. The MTP loss is cross-entropy on tok[t+2] plus (--mtp-distill) a
cross-entropy towards the backbone's own (stop-gradient) distribution at t+1, which is what
greedy acceptance measures.

Reproduce the committed model (docs/development.md; its numbers: docs/benchmarks.md):
  python training/train_tiny_qwen35.py prepare --out /tmp/tq35 --tokenizer-from models/tiny-qwen35-trained
  python training/train_tiny_qwen35.py train --data /tmp/tq35 --out /tmp/tq35/run --steps 1113 --batch 64
  python training/train_tiny_qwen35.py assemble --data /tmp/tq35 --weights /tmp/tq35/run \
      --out models/tiny-qwen35-trained
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test support package: support.*

# Model shape of the committed checkpoint (about 10M parameters, ~20 MB in bf16).
DEFAULT_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_layers": 8,
    "full_attention_interval": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "linear_key_heads": 2,
    "linear_value_heads": 4,
    "linear_head_dim": 64,
    "vocab_size": 4096,
    "mtp_layers": 1,
}

# The SpecPrefill draft for that model (models/tiny-qwen35-draft): same tokenizer, one gated delta layer
# and one full-attention layer (whose attention scores the prompt), no MTP head; ~1.5M parameters.
DRAFT_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_layers": 2,
    "full_attention_interval": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "linear_key_heads": 1,
    "linear_value_heads": 2,
    "linear_head_dim": 64,
    "vocab_size": 4096,
    "mtp_layers": 0,
}

SHAPES = {"trained": DEFAULT_SHAPE, "draft": DRAFT_SHAPE}


# ---------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[Path]:
    """Source files of the stdlib, vendored packages left out."""
    return [
        f for f in sorted(root.rglob("*.py"))
        if not any(p in ("site-packages", "dist-packages") for p in f.relative_to(root).parts)
    ]


def is_test(rel_path: str) -> bool:
    return any(p.startswith("test") for p in Path(rel_path).parts)


def is_heldout(rel_path: str, every: int = 10) -> bool:
    """One non-test file in ten, by path hash; test files only ever train."""
    return not is_test(rel_path) and int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % every == 0


def builder_kwargs(shape: dict) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_layers", "full_attention_interval", "num_heads", "num_kv_heads",
            "head_dim", "linear_key_heads", "linear_value_heads", "linear_head_dim", "mtp_layers", "vocab_size")
    # a shape without MTP layers is written without an MTP head (mtp/ absent)
    return {**{k: shape[k] for k in keys}, "mtp_placement": "subdir" if shape["mtp_layers"] else "none"}


def data_shape(data: Path) -> dict:
    """The shape `prepare` was run with (data dirs from before --shape hold the default one)."""
    f = data / "shape.json"
    return json.loads(f.read_text()) if f.exists() else DEFAULT_SHAPE


def build_skeleton(out: Path, shape: dict, train_files: list[Path], seed: int, tokenizer_from: Path | None) -> None:
    """Config, tokenizer, processor configs and random weights in the VLM checkpoint layout, by the
    project's builder. The BPE is trained on the train files only, unless `tokenizer_from` names a
    checkpoint whose tokenizer to reuse (models/tiny-qwen35-trained, to rebuild its corpus ids)."""
    from support.tiny_model import build_tiny_qwen35_vlm
    from support.tokenizer_builder import build_tokenizer

    if tokenizer_from is None:
        tokenizer_from = out.parent / "tokenizer"
        build_tokenizer(tokenizer_from, bpe_vocab=shape["vocab_size"] - 96, corpus=train_files,
                        corpus_bytes=4_000_000)
    build_tiny_qwen35_vlm(out, dtype="float32", seed=seed, force=True, tokenizer_from=tokenizer_from,
                          **builder_kwargs(shape))


def tokenize_files(tokenizer_json: Path, files: list[Path], sep_id: int) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep_id)
    return np.asarray(ids, dtype=np.uint16)


def cmd_prepare(a) -> None:
    root = Path(a.stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    train = [f for f in files if not is_heldout(str(f.relative_to(root)))]
    heldout = [f for f in files if is_heldout(str(f.relative_to(root)))]
    out = Path(a.out)
    skel = out / "skeleton"
    shape = SHAPES[a.shape]
    build_skeleton(skel, shape, train, a.seed, Path(a.tokenizer_from) if a.tokenizer_from else None)
    cfg = json.loads((skel / "config.json").read_text())
    sep = cfg["text_config"]["eos_token_id"]  # <|endoftext|> between files
    tr = tokenize_files(skel / "tokenizer.json", train, sep)
    ho = tokenize_files(skel / "tokenizer.json", heldout, sep)
    np.savez_compressed(out / "corpus.npz", train=tr, heldout=ho)
    (out / "text_config.json").write_text(json.dumps(cfg["text_config"], indent=2))
    (out / "shape.json").write_text(json.dumps(shape, indent=2))
    meta = {
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "train_files": len(train),
        "heldout_files": len(heldout),
        "heldout_rule": "non-test files with sha1(path relative to stdlib) % 10 == 0; site-packages excluded",
        "train_tokens": int(tr.size),
        "heldout_tokens": int(ho.size),
        "heldout_paths": [str(f.relative_to(root)) for f in heldout],
    }
    (out / "corpus_meta.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps({k: v for k, v in meta.items() if k != "heldout_paths"}))


# ---------------------------------------------------------------------------
# model (mlx-lm qwen3_5 TextModel + Qwen3.5 MTP head)
# ---------------------------------------------------------------------------


def make_models(text_config: dict):
    import mlx.nn as nn
    from mlx_lm.models.qwen3_5 import DecoderLayer, TextModel, TextModelArgs

    args = TextModelArgs.from_dict(text_config)

    class MTPHead(nn.Module):
        """Same module tree (and so the same weight names) as vllm_mlx's injected MTP module."""

        def __init__(self):
            super().__init__()
            H, eps = args.hidden_size, args.rms_norm_eps
            self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
            self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
            self.fc = nn.Linear(2 * H, H, bias=False)
            fa_idx = args.full_attention_interval - 1  # a full-attention layer
            self.layers = [DecoderLayer(args, layer_idx=fa_idx) for _ in range(text_config["mtp_num_hidden_layers"])]
            self.norm = nn.RMSNorm(H, eps=eps)

        def __call__(self, hidden, next_embeds):
            import mlx.core as mx

            x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
            for layer in self.layers:
                x = layer(x, mask="causal" if x.shape[1] > 1 else None)
            return self.norm(x)

    class Trainee(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = TextModel(args)
            if text_config["mtp_num_hidden_layers"]:
                self.mtp = MTPHead()

    return Trainee(), args


def init_weights(model, seed: int) -> None:
    """Scaled init: N(0, 0.02) matrices, output projections shrunk by depth, GDN decays as Qwen's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    n_layers = len(model.lm.model.layers) + (len(model.mtp.layers) if "mtp" in model else 0)
    new = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("A_log"):
            new.append((k, mx.log(mx.random.uniform(1.0, 16.0, v.shape))))
        elif k.endswith("dt_bias") or v.ndim == 1:
            new.append((k, mx.ones_like(v)))
        elif "conv1d" in k:
            new.append((k, mx.random.normal(v.shape) / math.sqrt(v.shape[1])))
        else:
            std = 0.02
            if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                std = 0.02 / math.sqrt(2 * n_layers)
            new.append((k, std * mx.random.normal(v.shape)))
    model.update(tree_unflatten(new))


def losses(model, x, distill: float):
    """Backbone CE on tok[t+1], MTP CE on tok[t+2] (+ distillation), and MTP agreement stats."""
    import mlx.core as mx
    import mlx.nn as nn

    lm = model.lm
    h = lm.model(x[:, :-1])  # post-norm hidden, positions 0..T-1
    logits = lm.lm_head(h)
    main = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
    if "mtp" not in model:  # a model without an MTP head (the SpecPrefill draft)
        zero = mx.zeros(())
        return main, zero, zero, zero
    # MTP at t: hidden h[t] and token t+1 predict token t+2, t = 0..T-2
    e = lm.model.embed_tokens(x[:, 1:-1])
    m_logits = lm.lm_head(model.mtp(h[:, :-1], e))
    m_true = nn.losses.cross_entropy(m_logits, x[:, 2:], reduction="mean")
    teacher = mx.stop_gradient(mx.softmax(logits[:, 1:].astype(mx.float32), axis=-1))
    m_kd = -(teacher * nn.log_softmax(m_logits.astype(mx.float32), axis=-1)).sum(-1).mean()
    agree = (mx.argmax(m_logits, -1) == mx.argmax(logits[:, 1:], -1)).astype(mx.float32).mean()
    return main, m_true, m_kd, agree


# ---------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------


def batches(tokens: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    hi = tokens.size - seq - 2
    while True:
        starts = rng.integers(0, hi, size=batch)
        yield np.stack([tokens[s : s + seq + 2] for s in starts]).astype(np.int32)


def evaluate(model, tokens: np.ndarray, seq: int, batch: int, max_windows: int, distill: float) -> dict:
    """Teacher-forced held-out metrics over consecutive windows."""
    import mlx.core as mx

    n = min(max_windows, (tokens.size - 2) // (seq + 2))
    rows = np.stack([tokens[i * (seq + 2) : (i + 1) * (seq + 2)] for i in range(n)]).astype(np.int32)
    tot = {"main": 0.0, "mtp": 0.0, "agree": 0.0}
    count = 0
    for i in range(0, n, batch):
        xb = mx.array(rows[i : i + batch])
        main, m_true, _, agree = losses(model, xb, distill)
        mx.eval(main, m_true, agree)
        w = xb.shape[0]
        tot["main"] += main.item() * w
        tot["mtp"] += m_true.item() * w
        tot["agree"] += agree.item() * w
        count += w
    main = tot["main"] / count
    return {
        "heldout_tokens": int(count * seq),
        "heldout_ce": main,
        "heldout_ppl": math.exp(main),
        "heldout_mtp_ce": tot["mtp"] / count,
        "heldout_mtp_agreement_teacher_forced": tot["agree"] / count,
    }


def save_sharded(out: Path, weights: dict, shard_bytes: int = 14 << 20) -> None:
    """fp32 weights in trained-NN.safetensors shards small enough to travel back from the GPU machine."""
    import mlx.core as mx

    shard, size, n = {}, 0, 0
    for k in sorted(weights):
        v = weights[k].astype(mx.float32)
        if shard and size + v.nbytes > shard_bytes:
            mx.save_safetensors(str(out / f"trained-{n:02d}.safetensors"), shard)
            shard, size, n = {}, 0, n + 1
        shard[k] = v
        size += v.nbytes
    mx.save_safetensors(str(out / f"trained-{n:02d}.safetensors"), shard)


def load_trained(weights_dir: Path) -> dict:
    import mlx.core as mx

    out = {}
    for f in sorted(Path(weights_dir).glob("trained-*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def cmd_train(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from chunked_gated_delta import chunked_recurrence

    with chunked_recurrence(a.gdn_chunk):  # training and its evaluation only: serving runs mlx-lm's own recurrence
        _train(a)


def _train(a) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    data = Path(a.data)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text_config = json.loads((data / "text_config.json").read_text())
    corpus = np.load(data / "corpus.npz")
    train_tokens, heldout = corpus["train"], corpus["heldout"]

    mx.random.seed(a.seed)
    model, _ = make_models(text_config)
    init_weights(model, a.seed)
    model.train()
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))

    def lr_at(step, total):
        warm = min(a.warmup, max(1, total // 10))
        if step < warm:
            return a.lr * (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    # Step count fixed up front (--steps) or picked from --time-budget after timing a probe; the
    # chosen count is logged so a rerun with --steps reproduces the run. The learning rate lives in
    # the optimizer state (an input of the compiled step), so it is set from Python each step.
    total = a.steps or a.max_steps
    opt = optim.AdamW(learning_rate=a.lr, weight_decay=a.weight_decay, betas=[0.9, 0.95])

    def loss_fn(m, x):
        main, m_true, m_kd, agree = losses(m, x, a.mtp_distill)
        mtp = (1 - a.mtp_distill) * m_true + a.mtp_distill * m_kd
        return main + a.mtp_weight * mtp, (main, m_true, agree)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state, mx.random.state]

    def step(x):
        (loss, aux), grads = grad_fn(model, x)
        grads, _ = optim.clip_grad_norm(grads, a.clip)
        opt.update(model, grads)
        return loss, aux

    step_plain = step
    step = mx.compile(step, inputs=state, outputs=state) if a.compile else step
    rng = np.random.default_rng(a.seed)
    it = batches(train_tokens, a.batch, a.seq, rng)
    log = []
    t0 = time.perf_counter()
    i = 0
    probe_done = a.steps is not None
    while i < total:
        x = mx.array(next(it))
        opt.learning_rate = lr_at(i, total)
        try:
            loss, (main, m_true, agree) = step(x)
            mx.eval(loss, state)
        except Exception as exc:  # noqa: BLE001 - a backend without compile support still trains
            if i > 0 or not a.compile:
                raise
            print(f"compiled step failed ({exc!r}); training uncompiled", flush=True)
            step = step_plain
            loss, (main, m_true, agree) = step(x)
            mx.eval(loss, state)
        i += 1
        if i == 1:
            t_first = time.perf_counter() - t0
        if not probe_done and i == a.probe_start:
            t_probe = time.perf_counter()
        if not probe_done and i == a.probe_start + a.probe_steps:
            # timed after a warm-up: the first steps include compilation (minutes on MLX CUDA)
            per = (time.perf_counter() - t_probe) / a.probe_steps
            total = max(i + 1, int((a.time_budget - (time.perf_counter() - t0)) / per) + i)
            total = min(total, a.max_steps)
            probe_done = True
            print(f"probe: {per*1000:.1f} ms/step -> {total} steps", flush=True)
        if a.steps is None and time.perf_counter() - t0 > 1.15 * a.time_budget:
            print(f"time budget exceeded at step {i}; stopping", flush=True)
            total = i
        if i % a.log_every == 0 or i == total:
            rec = {"step": i, "loss": loss.item(), "main_ce": main.item(), "mtp_ce": m_true.item(),
                   "mtp_agree": agree.item(), "lr": float(opt.learning_rate), "s": time.perf_counter() - t0}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    ev = evaluate(model, heldout, a.seq, a.batch, a.eval_windows, a.mtp_distill)
    print(json.dumps(ev), flush=True)

    save_sharded(out, dict(tree_flatten(model.parameters())))
    summary = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "params": int(n_params),
        "steps": i,
        "batch": a.batch,
        "seq": a.seq,
        "tokens_seen": int(i * a.batch * a.seq),
        "train_tokens": int(train_tokens.size),
        "train_seconds": train_s,
        "first_step_seconds": t_first,
        "ms_per_step": 1000 * (train_s - t_first) / max(1, i - 1),
        "args": vars(a),
        "eval": ev,
        "log": log,
    }
    (out / "train_log.json").write_text(json.dumps(summary, indent=2))


# ---------------------------------------------------------------------------
# assemble
# ---------------------------------------------------------------------------


def build_checkpoint_skeleton(out: Path, data: Path, dtype: str) -> None:
    """The project's builder writes config, processor configs and the (random) vision tower, with
    the tokenizer the corpus was tokenized with."""
    from support.tiny_model import build_tiny_qwen35_vlm

    build_tiny_qwen35_vlm(out, dtype=dtype, force=True, tokenizer_from=data / "skeleton",
                          **builder_kwargs(data_shape(data)))


def cmd_assemble(a) -> None:
    import mlx.core as mx

    data, out = Path(a.data), Path(a.out)
    trained = load_trained(Path(a.weights))
    build_checkpoint_skeleton(out, data, a.dtype)
    cfg = json.loads((out / "config.json").read_text())
    trained_cfg = json.loads((data / "text_config.json").read_text())
    diff = {k for k in set(cfg["text_config"]) | set(trained_cfg)
            if k != "dtype" and cfg["text_config"].get(k) != trained_cfg.get(k)}
    if diff:
        raise SystemExit(f"skeleton text_config differs from the trained one in {sorted(diff)}")
    dtype = getattr(mx, a.dtype)
    main = dict(mx.load(str(out / "model.safetensors")))
    mtp = {}
    for k, v in trained.items():
        if k.startswith("lm."):
            name = "language_model." + k[len("lm.") :]
            if name not in main or main[name].shape != v.shape:
                raise SystemExit(f"trained weight {name} {v.shape} does not fit the skeleton")
            main[name] = v if k.endswith("A_log") else v.astype(dtype)  # A_log stays fp32 as mlx keeps it
        elif k.startswith("mtp."):
            mtp[k] = v.astype(dtype)
    mx.save_safetensors(str(out / "model.safetensors"), main, metadata={"format": "mlx"})
    idx = {"metadata": {"total_size": sum(v.nbytes for v in main.values())},
           "weight_map": {k: "model.safetensors" for k in sorted(main)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2))
    if mtp:
        mx.save_safetensors(str(out / "mtp" / "weights.safetensors"), mtp, metadata={"format": "mlx"})
        cfg["text_config"]["mtp_hidden_state_mode"] = "post_norm"  # what the head was trained on
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(json.dumps({"out": str(out), "bytes": size, "main_tensors": len(main), "mtp_tensors": len(mtp)}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--stdlib", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default="trained",
                   help="model shape: the trained model's, or its SpecPrefill draft's (2 layers, no MTP head)")
    p.add_argument("--tokenizer-from", default=None,
                   help="reuse this checkpoint's tokenizer (models/tiny-qwen35-trained reproduces its corpus)")
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=None, help="fixed step count (reproducible)")
    t.add_argument("--time-budget", type=float, default=240.0, help="seconds, used when --steps is not given")
    t.add_argument("--max-steps", type=int, default=20_000)
    t.add_argument("--probe-start", type=int, default=20)
    t.add_argument("--probe-steps", type=int, default=20)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--mtp-weight", type=float, default=0.5)
    t.add_argument("--mtp-distill", type=float, default=0.5)
    t.add_argument("--eval-windows", type=int, default=256)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--gdn-chunk", type=int, default=16, help="chunked gated delta for training; 0 = mlx-lm's loop")
    t.add_argument("--no-compile", dest="compile", action="store_false")
    s = sub.add_parser("assemble")
    s.add_argument("--data", required=True)
    s.add_argument("--weights", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train, "assemble": cmd_assemble}[a.cmd](a)


if __name__ == "__main__":
    main()
