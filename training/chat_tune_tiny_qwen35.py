#!/usr/bin/env python3
"""Chat fine-tune of the committed tiny model: it learns to end its replies with <|im_end|>.

Starts from a checkpoint's weights (models/tiny-qwen35-trained), trains backbone and MTP head jointly with
train_tiny_qwen35's MTP loss on two batches a step: plain stdlib windows (all tokens; keeps code modelling and MTP
acceptance) and chat samples from training/chat_samples.py (loss on the assistant replies only, <|im_end|>
included), packed into rows with some long rows (agent-like system prompts and many tools).

  train     (any MLX device) writes chat-NN.safetensors (fp32 shards) and train_log.json.
  assemble  (CPU) copies the base checkpoint, puts the tuned weights in (in its dtypes) and declares --context
            positions.

  python training/chat_tune_tiny_qwen35.py train --base models/tiny-qwen35-trained --out /tmp/chat --steps 40
  python training/chat_tune_tiny_qwen35.py assemble --base models/tiny-qwen35-trained --weights /tmp/chat \\
      --out /tmp/chat/model
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN35_CONTEXT = 262144  # Qwen3.5's declared context (max_position_embeddings)


def load_base(model, base: Path) -> None:
    """The checkpoint's language model and MTP head into train_tiny_qwen35's Trainee, as fp32."""
    import mlx.core as mx

    w = mx.load(str(base / "model.safetensors"))
    params = [("lm." + k[len("language_model.") :], v.astype(mx.float32)) for k, v in w.items()
              if k.startswith("language_model.")]
    mtp = base / "mtp" / "weights.safetensors"
    if mtp.exists():
        params += [(k, v.astype(mx.float32)) for k, v in mx.load(str(mtp)).items()]
    model.load_weights(params, strict=True)


def corpus_tokens(tokenizer: Any, sources: list, rng: np.random.Generator, files: int) -> np.ndarray:
    sep = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for i in rng.permutation(len(sources))[:files]:
        ids.extend(tokenizer.encode("\n".join(sources[int(i)].lines) + "\n", add_special_tokens=False))
        ids.append(sep)
    return np.asarray(ids, dtype=np.int32)


def chat_rows(rng: np.random.Generator, tokenizer: Any, sources: list, batch: int, seq: int,
              long_rows: bool, end_weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` rows of seq+2 tokens: chat samples packed from position 0, the rest padding; mask 1 on replies,
    ``end_weight`` on each reply's last two tokens (the blank line and <|im_end|>)."""
    from chat_samples import build_sample

    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    x = np.full((batch, seq + 2), pad, dtype=np.int32)
    mask = np.zeros((batch, seq + 2), dtype=np.float32)
    # short rows get conversations sized to fit (system prose and tools scale with the row)
    max_tools, max_parts = (40, 8) if long_rows else (max(1, min(40, seq // 100)), max(0, min(5, seq // 400)))
    for b in range(batch):
        pos = 0
        for attempt in range(16):
            s = build_sample(rng, tokenizer, sources, max_tools=max_tools, max_parts=max_parts,
                             long_system=long_rows and pos == 0)
            ids = s.prompt + s.reply
            if pos + len(ids) > seq + 2:
                if pos > 0 or attempt == 15:
                    break
                continue
            x[b, pos : pos + len(ids)] = ids
            mask[b, pos + len(s.prompt) : pos + len(ids)] = 1.0
            mask[b, pos + len(ids) - 2 : pos + len(ids)] = end_weight
            pos += len(ids)
    return x, mask


def masked_losses(model, x, mask, distill: float, end_id: int = -1):
    """train_tiny_qwen35.losses with a per-token weight: backbone CE at t+1, MTP CE (+ distillation) at t+2; and the
    backbone's greedy accuracy where the target is ``end_id`` (<|im_end|>)."""
    import mlx.core as mx
    import mlx.nn as nn

    lm = model.lm
    h = lm.model(x[:, :-1])
    logits = lm.lm_head(h)
    m1, m2 = mask[:, 1:], mask[:, 2:]
    n1, n2 = mx.maximum(m1.sum(), 1.0), mx.maximum(m2.sum(), 1.0)
    main = (nn.losses.cross_entropy(logits, x[:, 1:], reduction="none") * m1).sum() / n1
    e = lm.model.embed_tokens(x[:, 1:-1])
    m_logits = lm.lm_head(model.mtp(h[:, :-1], e))
    m_true = (nn.losses.cross_entropy(m_logits, x[:, 2:], reduction="none") * m2).sum() / n2
    teacher = mx.stop_gradient(mx.softmax(logits[:, 1:].astype(mx.float32), axis=-1))
    m_kd = (-(teacher * nn.log_softmax(m_logits.astype(mx.float32), axis=-1)).sum(-1) * m2).sum() / n2
    agree = ((mx.argmax(m_logits, -1) == mx.argmax(logits[:, 1:], -1)).astype(mx.float32) * m2).sum() / n2
    ends = (x[:, 1:] == end_id).astype(mx.float32) * m1
    end_acc = ((mx.argmax(logits, -1) == end_id).astype(mx.float32) * ends).sum() / mx.maximum(ends.sum(), 1.0)
    return main, m_true, m_kd, agree, mx.stop_gradient(end_acc)


def save_tuned(out: Path, model, shard_bytes: int = 14 << 20) -> list[str]:
    """The tuned weights (fp32) in the checkpoint's names, in shards small enough to travel."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = {}
    for k, v in tree_flatten(model.parameters()):
        name = "language_model." + k[len("lm.") :] if k.startswith("lm.") else k
        weights[name] = v.astype(mx.float32)
    files, shard, size = [], {}, 0
    for k in sorted(weights):
        if shard and size + weights[k].nbytes > shard_bytes:
            files.append(f"chat-{len(files):02d}.safetensors")
            mx.save_safetensors(str(out / files[-1]), shard)
            shard, size = {}, 0
        shard[k] = weights[k]
        size += weights[k].nbytes
    files.append(f"chat-{len(files):02d}.safetensors")
    mx.save_safetensors(str(out / files[-1]), shard)
    return files


def cmd_train(a) -> None:
    from chunked_gated_delta import chunked_recurrence

    with chunked_recurrence(a.gdn_chunk):  # training only: serving runs mlx-lm's own recurrence
        _train(a)


def _train(a) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from chat_samples import load_sources
    from train_tiny_qwen35 import make_models
    from transformers import AutoTokenizer

    base, out = Path(a.base), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_setup = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    sources = load_sources(Path(a.stdlib), heldout=False)
    rng = np.random.default_rng(a.seed)
    corpus = corpus_tokens(tokenizer, sources, rng, a.corpus_files)
    text_config = json.loads((base / "config.json").read_text())["text_config"]
    mx.random.seed(a.seed)
    model, _ = make_models(text_config)
    load_base(model, base)
    model.train()
    setup_s = time.perf_counter() - t_setup
    print(json.dumps({"setup_s": setup_s, "sources": len(sources), "corpus_tokens": int(corpus.size)}), flush=True)

    opt = optim.AdamW(learning_rate=a.lr, weight_decay=a.weight_decay, betas=[0.9, 0.95])

    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def part_loss(m, x, mask):
        main, m_true, m_kd, agree, end_acc = masked_losses(m, x, mask, a.mtp_distill, end_id)
        return main + a.mtp_weight * ((1 - a.mtp_distill) * m_true + a.mtp_distill * m_kd), main, agree, end_acc

    def loss_fn(m, xc, mc, xs, ms):
        lc, main_c, agree_c, _ = part_loss(m, xc, mc)
        ls, main_s, agree_s, end_acc = part_loss(m, xs, ms)
        return lc + a.chat_weight * ls, (main_c, agree_c, main_s, agree_s, end_acc)

    grad_fn = nn.value_and_grad(model, loss_fn)

    def make_batch(j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        long_step = a.long_every > 0 and j % a.long_every == a.long_every - 1
        starts = rng.integers(0, corpus.size - a.seq - 2, size=a.batch)
        xc = np.stack([corpus[s : s + a.seq + 2] for s in starts])
        if long_step:
            xs, ms = chat_rows(rng, tokenizer, sources, a.long_batch, a.long_seq, True, a.end_weight)
        else:
            xs, ms = chat_rows(rng, tokenizer, sources, a.chat_batch, a.chat_seq, False, a.end_weight)
        return xc, xs, ms, long_step

    # the samples are rendered and tokenized on a thread while the device runs the step before
    batches: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def produce() -> None:
        j = 0
        while not stop.is_set():
            item = make_batch(j)
            while not stop.is_set():
                try:
                    batches.put(item, timeout=0.5)
                    break
                except queue.Full:
                    continue
            j += 1

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    log: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    i = 0
    while True:
        elapsed = time.perf_counter() - t0
        if (a.steps is not None and i >= a.steps) or (a.steps is None and elapsed >= a.time_budget):
            break
        frac = i / a.steps if a.steps else elapsed / a.time_budget
        lr = a.lr * min(1.0, (i + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        opt.learning_rate = lr
        xc, xs, ms, long_step = batches.get()
        (loss, aux), grads = grad_fn(model, mx.array(xc), mx.ones(xc.shape), mx.array(xs), mx.array(ms))
        grads, _ = optim.clip_grad_norm(grads, a.clip)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        i += 1
        if i == 1:
            t_first = time.perf_counter() - t0
        if i % a.log_every == 0 or i == 1:
            main_c, agree_c, main_s, agree_s, end_acc = (v.item() for v in aux)
            rec = {"step": i, "loss": loss.item(), "corpus_ce": main_c, "corpus_mtp_agree": agree_c,
                   "reply_ce": main_s, "reply_mtp_agree": agree_s, "reply_end_acc": end_acc, "long": bool(long_step), "lr": lr,
                   "s": time.perf_counter() - t0}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_s = time.perf_counter() - t0
    stop.set()
    model.eval()
    files = save_tuned(out, model)
    summary = {"device": str(mx.default_device()), "mlx": mx.__version__, "steps": i, "train_seconds": train_s,
               "first_step_seconds": t_first, "ms_per_step": 1000 * (train_s - t_first) / max(1, i - 1),
               "setup_seconds": setup_s, "corpus_tokens": int(corpus.size), "weights": files, "args": vars(a),
               "log": log}
    (out / "train_log.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("steps", "train_seconds", "first_step_seconds", "ms_per_step")}))


def cmd_assemble(a) -> None:
    import mlx.core as mx

    base, out = Path(a.base), Path(a.out)
    tuned: dict[str, Any] = {}
    for f in sorted(Path(a.weights).glob("chat-*.safetensors")):
        tuned.update(mx.load(str(f)))
    if not tuned:
        raise SystemExit(f"no chat-*.safetensors under {a.weights}")
    if out.resolve() != base.resolve():
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(base, out)
    main = dict(mx.load(str(out / "model.safetensors")))
    mtp_file = out / "mtp" / "weights.safetensors"
    mtp = dict(mx.load(str(mtp_file))) if mtp_file.exists() else {}
    for k, v in tuned.items():
        dest = main if k.startswith("language_model.") else mtp
        if k not in dest or dest[k].shape != v.shape:
            raise SystemExit(f"tuned weight {k} {v.shape} does not fit the base checkpoint")
        dest[k] = v.astype(dest[k].dtype)  # the base's dtypes: bf16, A_log fp32 in the committed model
    missing = [k for k in list(main) + list(mtp) if k.startswith(("language_model.", "mtp.")) and k not in tuned]
    if missing:
        raise SystemExit(f"tuned weights lack {missing[:5]} ...")
    mx.save_safetensors(str(out / "model.safetensors"), main, metadata={"format": "mlx"})
    if mtp:
        mx.save_safetensors(str(mtp_file), mtp, metadata={"format": "mlx"})
    idx = {"metadata": {"total_size": sum(v.nbytes for v in main.values())},
           "weight_map": {k: "model.safetensors" for k in sorted(main)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2))
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = a.context
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(json.dumps({"out": str(out), "tensors": len(tuned), "context": a.context}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--base", required=True, help="the checkpoint to start from")
    t.add_argument("--out", required=True)
    t.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=None, help="fixed step count; else --time-budget seconds")
    t.add_argument("--time-budget", type=float, default=240.0)
    t.add_argument("--batch", type=int, default=32, help="corpus rows a step")
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--chat-batch", type=int, default=8)
    t.add_argument("--chat-seq", type=int, default=2048)
    t.add_argument("--long-batch", type=int, default=1)
    t.add_argument("--long-seq", type=int, default=8192)
    t.add_argument("--long-every", type=int, default=5, help="every Nth step's chat rows are long; 0 = none")
    t.add_argument("--corpus-files", type=int, default=400)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--chat-weight", type=float, default=1.0)
    t.add_argument("--end-weight", type=float, default=1.0, help="loss weight of a reply's blank line and <|im_end|>")
    t.add_argument("--mtp-weight", type=float, default=0.5)
    t.add_argument("--mtp-distill", type=float, default=0.5)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--gdn-chunk", type=int, default=16, help="chunked gated delta for training; 0 = mlx-lm's loop")
    s = sub.add_parser("assemble")
    s.add_argument("--base", required=True)
    s.add_argument("--weights", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--context", type=int, default=QWEN35_CONTEXT, help="max_position_embeddings to declare")
    a = ap.parse_args(argv)
    {"train": cmd_train, "assemble": cmd_assemble}[a.cmd](a)


if __name__ == "__main__":
    main()
