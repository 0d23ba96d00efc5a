"""References for logits processing, computed straight from the model (test helper): a direct forward
pass over the whole sequence at every position, penalties in numpy, argmax, log-softmax."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def direct_logits(model, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of one forward over the whole sequence (no cache), as float64."""
    return np.array(model(mx.array([ids]))[0].astype(mx.float32)).astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def generated_logprobs(model, prompt: list[int], ids: list[int]) -> np.ndarray:
    """[len(ids), V]: the log-softmax of the model's logits at each generated position."""
    return log_softmax(direct_logits(model, prompt + ids)[len(prompt) - 1 : len(prompt) - 1 + len(ids)])


def reference_greedy(model, prompt, n, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None, eos=()):
    """Greedy decoding with OpenAI presence/frequency penalties over generated tokens and the HF
    repetition penalty over prompt + generated tokens, straight from the model's logits."""
    out: list[int] = []
    while len(out) < n:
        x = direct_logits(model, prompt + out)[-1]
        if repetition != 1.0:
            seen = sorted(set(prompt) | set(out))
            x[seen] = np.where(x[seen] < 0, x[seen] * repetition, x[seen] / repetition)
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        for t, b in (bias or {}).items():
            x[t] += b
        out.append(int(np.argmax(x)))
        if out[-1] in eos:
            break
    return out
