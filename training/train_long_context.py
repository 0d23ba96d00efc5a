#!/usr/bin/env python3
"""Train a long-context Qwen3.5-shaped target and its SpecPrefill draft together, on long windows of code
with a synthetic retrieval task mixed in (retrieval_task.py), so the target has to read far back.

  prepare  (CPU, any machine with `tokenizers`): tokenize Python's standard library with the tokenizer of
           models/tiny-qwen35-trained (train / held-out files split by train_tiny_qwen35.py's rule, file order
           by path hash) into corpus.npz.
  train    (any MLX device; meant for MLX's CUDA backend): both models in one compiled step on the same
           batches, each with the language-model loss plus --retrieval-weight x the loss on the answers'
           tokens; steps picked from --time-budget after a timed probe (the first step compiles). Writes
           RUN/target and RUN/draft (text_config.json, trained-NN.safetensors), RUN/tokenizer.json and
           RUN/train_log.json (with teacher-forced held-out retrieval accuracy for both models).

The pair is reproducible from the seed and the logged step count (--steps), not committed (the target is
15.5M parameters with --tie). Both load with ``load_model(RUN / "target")`` as mlx-lm qwen3_5 text models, the class the
server's text engine runs. The GPU job (benchmarks/gpu/specprefill_lc.sh) runs prepare, train, and then
benchmarks/specprefill_retrieval.py on the result.

  python training/train_long_context.py prepare --out /tmp/lc
  python training/train_long_context.py train --data /tmp/lc --out /tmp/lc/run --time-budget 300
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
TOKENIZER = REPO / "models" / "tiny-qwen35-trained" / "tokenizer.json"

# 17.6M parameters untied, 15.5M with --tie (2.1M of them the embedding): 4 layers, [gated delta, attention] x2, vocab
# 4096. Wide and shallow: a training step's cost is mostly the gated delta's sequential chunks, per layer.
TARGET = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "full_attention_interval": 2,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4,
          "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
# 2.6M (1.8M with --tie): one gated delta layer (its short convolution sees the previous tokens) and one attention layer.
DRAFT = {"hidden_size": 192, "intermediate_size": 576, "num_hidden_layers": 2, "full_attention_interval": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
# --small: a CPU smoke shape
SMALL_TARGET = {**TARGET, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 8, "full_attention_interval": 4,
                "num_attention_heads": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
SMALL_DRAFT = {**DRAFT, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 2, "num_key_value_heads": 1,
               "linear_num_key_heads": 1, "linear_num_value_heads": 2}
# --shape tiny: the CPU proof of the recipe (4 layers, [gated delta, attention] x2)
TINY_TARGET = {**SMALL_TARGET, "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 4, "full_attention_interval": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 2}
# --shape proof: the least that shows the recipe on a slow CPU: [gated delta, attention] each (mlx-lm's qwen3_5 needs a
# gated-delta layer), the draft narrow
PROOF_TARGET = {**TINY_TARGET, "num_hidden_layers": 2}
PROOF_DRAFT = {**SMALL_DRAFT, "hidden_size": 32, "intermediate_size": 64}
SHAPES = {"full": (TARGET, DRAFT), "small": (SMALL_TARGET, SMALL_DRAFT), "tiny": (TINY_TARGET, SMALL_DRAFT),
          "proof": (PROOF_TARGET, PROOF_DRAFT)}


def text_config(shape: dict, tie: bool = False) -> dict:
    """A qwen3_5_text config: the committed trained model's (tokenizer, RoPE, norms) with this shape. ``tie``: the
    output projection is the embedding (a copy learnt on some tokens then holds for any token)."""
    base = json.loads((REPO / "models" / "tiny-qwen35-trained" / "config.json").read_text())["text_config"]
    cfg = {**base, **shape, "mtp_num_hidden_layers": 0, "tie_word_embeddings": tie, "max_position_embeddings": 32768}
    cfg.pop("mtp_hidden_state_mode", None)
    n, k = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    return cfg


# ---------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------


def cmd_prepare(a) -> None:
    from tokenizers import Tokenizer
    from train_tiny_qwen35 import is_heldout, stdlib_files

    root = Path(a.stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib_files(root), key=lambda f: hashlib.sha1(str(f.relative_to(root)).encode()).hexdigest())
    tok = Tokenizer.from_file(str(TOKENIZER))
    sep = tok.token_to_id("<|endoftext|>")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[int]] = {"train": [], "heldout": []}
    limits = {"train": a.train_tokens, "heldout": a.heldout_tokens}
    for split in ("train", "heldout"):
        chosen = [f for f in files if is_heldout(str(f.relative_to(root))) == (split == "heldout")]
        for i in range(0, len(chosen), 64):
            if len(parts[split]) >= limits[split]:
                break
            texts = [f.read_text(encoding="utf-8", errors="replace") for f in chosen[i : i + 64]]
            for enc in tok.encode_batch(texts, add_special_tokens=False):
                parts[split] += [*enc.ids, sep]
    tr = np.asarray(parts["train"][: a.train_tokens], dtype=np.uint16)
    ho = np.asarray(parts["heldout"][: a.heldout_tokens], dtype=np.uint16)
    np.savez_compressed(out / "corpus.npz", train=tr, heldout=ho)
    meta = {"stdlib": str(root), "python": sys.version.split()[0], "train_tokens": int(tr.size),
            "heldout_tokens": int(ho.size), "tokenizer": str(TOKENIZER.relative_to(REPO))}
    (out / "corpus_meta.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta), flush=True)


# ---------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------


def build(cfg: dict):
    from mlx_lm.models.qwen3_5 import TextModel, TextModelArgs

    return TextModel(TextModelArgs.from_dict(cfg))


def load_model(path: Path, dtype: str = "float32"):
    """A trained model of this script (RUN/target or RUN/draft) as an mlx-lm qwen3_5 text model, eval mode."""
    import mlx.core as mx
    from train_tiny_qwen35 import load_trained

    model = build(json.loads((path / "text_config.json").read_text()))
    model.load_weights(list(load_trained(path).items()))
    model.set_dtype(getattr(mx, dtype))
    model.train(False)
    mx.eval(model.parameters())
    return model


def seq_losses(lm, x, mask):
    """(mean next-token CE, mean CE over masked targets, share of masked targets predicted right)."""
    import mlx.core as mx
    import mlx.nn as nn

    logits = lm(x[:, :-1])
    ce = nn.losses.cross_entropy(logits, x[:, 1:], reduction="none")
    m = mask[:, 1:]
    msum = mx.maximum(m.sum(), 1.0)
    right = (mx.argmax(logits, -1) == x[:, 1:]).astype(mx.float32)
    return ce.mean(), (ce * m).sum() / msum, (right * m).sum() / msum


# ---------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------


def batches(task, corpus: np.ndarray, batch: int, seq: int, pairs_per_k: tuple[float, float], rng: np.random.Generator):
    from retrieval_task import training_window

    fit = max(1, seq // (task.def_len + task.query_len))  # a window of pairs only, but a token of text
    lo, hi = (min(len(task.keys), fit, max(1, round(p * seq / 1024))) for p in pairs_per_k)  # keys are distinct in a window
    while True:
        rows = [training_window(task, corpus, rng, seq + 1, int(rng.integers(lo, hi + 1))) for _ in range(batch)]
        yield np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def heldout_retrieval(models: dict, task, heldout: np.ndarray, seq: int, windows: int, batch: int,
                      pairs_per_k: float) -> dict:
    import mlx.core as mx

    rng = np.random.default_rng(12345)
    it = batches(task, heldout, batch, seq, (pairs_per_k, pairs_per_k), rng)
    tot = {name: np.zeros(3) for name in models}
    n = 0
    for _ in range(max(1, windows // batch)):
        x, m = next(it)
        xb, mb = mx.array(x), mx.array(m)
        for name, lm in models.items():
            out = seq_losses(lm, xb, mb)
            mx.eval(out)
            tot[name] += [v.item() for v in out]
        n += 1
    return {name: {"heldout_ce": v[0] / n, "heldout_ppl": math.exp(v[0] / n), "answer_ce": v[1] / n,
                   "answer_token_acc_teacher_forced": v[2] / n} for name, v in tot.items()}


def parse_curriculum(text: str) -> list[tuple[int, int, float, float | None]]:
    """"256x64@80:0.3,512x16:0.3,4096x2:0.4" -> [(seq, batch, share of the training time, retrieval pairs per 1K tokens
    or None for --pairs-per-k)], shares summing to 1. ``@P``: a phase of P pairs per 1K tokens, as many as fit: at 80
    a window is almost all definitions and queries, where copying is the only way to lower the answers' loss."""
    phases: list[tuple[int, int, float, float | None]] = []
    try:
        for part in text.split(","):
            shape, _, share = part.partition(":")
            shape, _, dense = shape.partition("@")
            seq, _, batch = shape.partition("x")
            phases.append((int(seq), int(batch), float(share or 1.0), float(dense) if dense else None))
    except ValueError:
        phases = []
    if not phases or any(p[0] < 64 or p[1] < 1 or p[2] <= 0 or (p[3] is not None and p[3] <= 0) for p in phases):
        raise SystemExit(f"--curriculum: want SEQxBATCH[@PAIRS]:SHARE,... (SEQ >= 64, BATCH >= 1, PAIRS > 0, SHARE > 0), got {text!r}")
    total = sum(p[2] for p in phases)
    return [(q, b, sh / total, d) for q, b, sh, d in phases]


def cmd_train(a) -> None:
    from chunked_gated_delta import chunked_recurrence

    with chunked_recurrence(a.gdn_chunk):  # training and its evaluation only: serving runs mlx-lm's own recurrence
        _train(a)


def _train(a) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from retrieval_task import load_task
    from train_tiny_qwen35 import init_weights, save_sharded

    t0 = time.perf_counter()
    data, out = Path(a.data), Path(a.out)
    corpus = np.load(data / "corpus.npz")
    train_tokens, heldout = corpus["train"].astype(np.int32), corpus["heldout"].astype(np.int32)
    task, task_heldout = load_task(TOKENIZER, "train", value_pool=a.value_pool), load_task(TOKENIZER, "heldout")
    phases = parse_curriculum(a.curriculum)
    fixed = [int(x) for x in a.steps.split(",")] if a.steps else None
    if fixed is not None and len(fixed) != len(phases):
        raise SystemExit("--steps: one count per curriculum phase")
    pairs_per_k = tuple(float(x) for x in a.pairs_per_k.split(","))
    cfgs = {"target": text_config(SHAPES[a.shape][0], a.tie)}
    if not a.target_only:
        cfgs["draft"] = text_config(SHAPES[a.shape][1], a.tie)
    mx.random.seed(a.seed)

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            for name, cfg in cfgs.items():
                setattr(self, name, build(cfg))

    pair = Pair()
    for name in cfgs:  # init_weights reads .lm (and .mtp when present)
        holder = nn.Module()
        holder.lm = getattr(pair, name)
        init_weights(holder, a.seed + (name == "draft"))
    pair.train()
    params = {name: int(sum(v.size for _, v in tree_flatten(getattr(pair, name).parameters()))) for name in cfgs}
    print(json.dumps({"params": params, "curriculum": phases}), flush=True)

    def loss_fn(m, x, mask):
        lt, rt, at = seq_losses(m.target, x, mask)
        if a.target_only:
            return lt + a.retrieval_weight * rt, (lt, at, lt * 0, at * 0)
        ld, rd, ad = seq_losses(m.draft, x, mask)
        return lt + a.retrieval_weight * rt + ld + a.retrieval_weight * rd, (lt, at, ld, ad)

    opt = optim.AdamW(learning_rate=a.lr, weight_decay=a.weight_decay, betas=[0.9, 0.95])
    grad_fn = nn.value_and_grad(pair, loss_fn)
    state = [pair.state, opt.state, mx.random.state]

    def step(x, mask):
        (loss, aux), grads = grad_fn(pair, x, mask)
        grads, _ = optim.clip_grad_norm(grads, a.clip)
        opt.update(pair, grads)
        return loss, aux

    step_c = mx.compile(step, inputs=state, outputs=state) if a.compile else step

    def lr_at(i: int, progress: float) -> float:
        if i < a.warmup:
            return a.lr * (i + 1) / a.warmup
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    # Phases end at their share of the time left after the first step (which carries the backend's JIT), or
    # at --steps; the learning rate follows the same clock.
    rng = np.random.default_rng(a.seed)
    log: list[dict] = []
    phase_steps: list[int] = []
    i = 0
    t_first = 0.0
    t_train = time.perf_counter()
    t_start, t_end = t_train, t0 + a.time_budget
    cum = np.cumsum([p[2] for p in phases])
    total_fixed = sum(fixed) if fixed else 0
    for k, (seq, batch, _share, dense) in enumerate(phases):
        it = batches(task, train_tokens, batch, seq, (dense, dense) if dense else pairs_per_k, rng)
        done_here = 0
        while True:
            now = time.perf_counter()
            if fixed is not None:
                if done_here >= fixed[k]:
                    break
                progress = i / max(1, total_fixed)
            else:
                if i > 0 and now >= t_start + cum[k] * (t_end - t_start):
                    break
                progress = 0.0 if i == 0 else (now - t_start) / max(1e-9, t_end - t_start)
            x, m = next(it)
            opt.learning_rate = lr_at(i, progress)
            try:
                loss, (lt, at, ld, ad) = step_c(mx.array(x), mx.array(m))
                mx.eval(loss, state)
            except Exception as exc:  # noqa: BLE001 - a backend without compile support still trains
                if i > 0 or not a.compile:
                    raise
                print(f"compiled step failed ({exc!r}); training uncompiled", flush=True)
                step_c = step
                loss, (lt, at, ld, ad) = step_c(mx.array(x), mx.array(m))
                mx.eval(loss, state)
            i += 1
            done_here += 1
            now = time.perf_counter()
            if i == 1:
                t_first = now - t_train
                t_start = now
                print(f"first step {t_first:.1f} s", flush=True)
            if i % a.log_every == 0 or done_here == 1:
                rec = {"step": i, "phase": k, "seq": seq, "loss": loss.item(), "target_ce": lt.item(),
                       "target_answer_acc": at.item(), "draft_ce": ld.item(), "draft_answer_acc": ad.item(),
                       "lr": float(opt.learning_rate), "s": round(now - t0, 1)}
                log.append(rec)
                print(json.dumps(rec), flush=True)
        phase_steps.append(done_here)
        print(json.dumps({"phase": k, "seq": seq, "batch": batch, "steps": done_here, "s": round(time.perf_counter() - t0, 1)}),
              flush=True)
    train_s = time.perf_counter() - t_train
    pair.train(False)
    seq, batch, _, _ = phases[-1]
    models = {name: getattr(pair, name) for name in cfgs}
    # Held-out text either way; pairs of held-out tokens, then pairs of the training pools drawn afresh.
    ev = heldout_retrieval(models, task_heldout, heldout, seq, a.eval_windows, batch, sum(pairs_per_k) / 2)
    fresh = heldout_retrieval(models, task, heldout, seq, a.eval_windows, batch, sum(pairs_per_k) / 2)
    for name in ev:
        ev[name].update({f"fresh_pairs_{k}": v for k, v in fresh[name].items() if k.startswith("answer")})
    print(json.dumps(ev), flush=True)
    tok_out = out / "tokenizer.json"
    out.mkdir(parents=True, exist_ok=True)
    tok_out.write_bytes(TOKENIZER.read_bytes())
    for name in cfgs:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "text_config.json").write_text(json.dumps(cfgs[name], indent=2))
        save_sharded(d, dict(tree_flatten(getattr(pair, name).parameters())))
    tokens_seen = sum(n * q * b for n, (q, b, _, _) in zip(phase_steps, phases))
    summary = {"device": str(mx.default_device()), "mlx": mx.__version__, "params": params, "steps": i,
               "phase_steps": phase_steps, "reproduce": f"--steps {','.join(map(str, phase_steps))}",
               "tokens_seen": int(tokens_seen), "train_tokens": int(train_tokens.size),
               "train_seconds": round(train_s, 1), "first_step_seconds": round(t_first, 1), "args": vars(a),
               "eval": ev, "log": log}
    (out / "train_log.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("steps", "phase_steps", "train_seconds", "first_step_seconds")}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--stdlib", default=None)
    p.add_argument("--train-tokens", type=int, default=20_000_000)
    p.add_argument("--heldout-tokens", type=int, default=2_000_000)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shape", choices=sorted(SHAPES), default="full", help="small / tiny: CPU shapes (smoke run, recipe proof)")
    t.add_argument("--steps", default=None, help="fixed steps per curriculum phase, 'N,N,..' (reproduces a logged run)")
    t.add_argument("--time-budget", type=float, default=300.0, help="seconds from start to the last step")
    t.add_argument("--curriculum", default="512x16:0.45,1024x8:0.25,4096x2:0.3",
                   help="training phases SEQxBATCH[@PAIRS_PER_1K]:SHARE (SHARE of the time budget), short windows first")
    t.add_argument("--pairs-per-k", default="16,32", help="retrieval pairs per 1K tokens of a window: LO,HI")
    t.add_argument("--retrieval-weight", type=float, default=4.0)
    t.add_argument("--value-pool", type=int, default=0, help="training values: this many (a fixed draw), 0 = all ~2.7K")
    t.add_argument("--tie", action="store_true", help="tie the output projection to the embedding (both models)")
    t.add_argument("--target-only", action="store_true", help="train no draft (recipe probes)")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--eval-windows", type=int, default=16)
    t.add_argument("--log-every", type=int, default=20)
    t.add_argument("--gdn-chunk", type=int, default=32, help="chunked gated delta for training; 0 = mlx-lm's loop")
    t.add_argument("--no-compile", dest="compile", action="store_false")
    a = ap.parse_args(argv)
    {"prepare": cmd_prepare, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    main()
