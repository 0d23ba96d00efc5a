"""The MTP head's math (cross-checked against vllm-mlx's injected mtp_forward) and the
single-sequence greedy MTP speculative decode loop (must equal plain greedy token for token)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest

from support.reference_decode import greedy_generate, mtp_greedy_generate
from vllm_mlx_mtp_routing.model.mtp import forward_with_hidden
from vllm_mlx_mtp_routing.model.text_model import build_text_model

PROMPTS = [[11, 200, 37, 4000, 5, 981, 42, 7, 300], [5], list(range(100, 131))]


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny(tiny_vlm_factory):
    from mlx_vlm import load

    path = tiny_vlm_factory("float32", "subdir")
    vlm = load(str(path))[0]
    return path, vlm, build_text_model(vlm, path, _config(path))


def test_forward_with_hidden_is_the_backbone_forward(tiny):
    _, _, bundle = tiny
    model, ids = bundle.model, mx.array([PROMPTS[0]])
    logits, hidden = forward_with_hidden(model, ids)
    assert mx.array_equal(logits, model(ids))
    assert mx.array_equal(hidden, model.model(ids))  # post-norm by default
    _, pre = forward_with_hidden(model, ids, hidden_state_mode="pre_norm")
    assert mx.allclose(model.model.norm(pre), hidden, atol=1e-6).item()
    # With a cache, chunked: the same logits as one pass.
    cache = model.make_cache()
    first, _ = forward_with_hidden(model, ids[:, :4], cache)
    rest, _ = forward_with_hidden(model, ids[:, 4:], cache)
    assert mx.allclose(mx.concatenate([first, rest], axis=1), logits, atol=1e-4).item()


def test_head_matches_host_mtp_forward(tiny):
    """vllm-mlx's inject_mtp_support reads the subdir layout correctly: same math, same logits."""
    from vllm_mlx.text_model_from_vlm import build_text_model as host_build

    path, vlm, bundle = tiny
    host = host_build(vlm, path, enable_mtp=True)
    assert host is not None and hasattr(host, "mtp_forward")

    prompt = PROMPTS[0]
    logits, hidden = forward_with_hidden(bundle.model, mx.array([prompt]))
    x = int(mx.argmax(logits[0, -1]).item())
    tokens = mx.array([prompt[1:] + [x]])
    ours_cache, host_cache = bundle.mtp.make_cache(), host.make_mtp_cache()
    ours = bundle.mtp(hidden, tokens, ours_cache)
    theirs = host.mtp_forward(hidden, tokens, mtp_cache=host_cache)
    assert mx.allclose(ours, theirs, atol=1e-5, rtol=0).item()
    # One more pair on the warm caches (decode step).
    h1, t1 = hidden[:, -1:] * 0.5, mx.array([[17]])
    assert mx.allclose(bundle.mtp(h1, t1, ours_cache), host.mtp_forward(h1, t1, mtp_cache=host_cache),
                       atol=1e-5, rtol=0).item()
    assert ours_cache[0].offset == host_cache[0].offset == len(prompt) + 1


def test_draft_recurses_and_leaves_only_verified_entries(tiny):
    _, _, bundle = tiny
    head, prompt = bundle.mtp, PROMPTS[0]
    logits, hidden = forward_with_hidden(bundle.model, mx.array([prompt]))
    tokens = mx.array([prompt[1:] + [int(mx.argmax(logits[0, -1]).item())]])

    cache = head.make_cache()
    drafts = head.draft(hidden, tokens, cache, k=3)
    assert drafts.shape == (1, 3) and cache[0].offset == len(prompt)

    # By hand: feed the head its own output hidden state and previous draft.
    manual = head.make_cache()
    out, _ = head.forward(hidden, tokens, manual)
    expect = [int(mx.argmax(head(hidden, tokens, head.make_cache())[0, -1]).item())]
    for _ in range(2):
        out, _ = head.forward(out[:, -1:], mx.array([[expect[-1]]]), manual)
        expect.append(int(mx.argmax(bundle.model.lm_head(out)[0, -1]).item()))
    assert drafts[0].tolist() == expect


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_decode_equals_greedy(tiny, k):
    _, _, bundle = tiny
    for prompt in PROMPTS:
        base = greedy_generate(bundle.model, prompt, 24)
        spec = mtp_greedy_generate(bundle.model, bundle.mtp, prompt, 24, k=k)
        assert spec.tokens == base.tokens
        assert spec.drafted == k * spec.verify_steps


class OracleDrafter:
    """Drafts the true greedy continuation, except at `wrong` positions: every accept/reject path."""

    def __init__(self, stream: list[int], vocab: int, wrong: set[int] = frozenset()):
        self.stream, self.vocab, self.wrong, self.pairs = stream, vocab, wrong, 0

    def make_cache(self):
        return []

    def draft(self, hidden, tokens, cache, k=1):
        L = tokens.shape[1]
        # The loop must hand over exactly the verified tokens, paired with their hidden states.
        assert tokens[0].tolist() == self.stream[self.pairs + 1 : self.pairs + 1 + L]
        assert hidden.shape[:2] == (1, L)
        self.pairs += L
        out = []
        for i in range(self.pairs + 1, self.pairs + 1 + k):
            t = self.stream[i] if i < len(self.stream) else 0
            out.append((t + 1) % self.vocab if i in self.wrong else t)
        return mx.array([out])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("corrupt", [False, True])
def test_mtp_decode_with_accepts_and_forced_rejections(tiny, k, corrupt):
    _, _, bundle = tiny
    vocab = bundle.model.args.vocab_size
    for prompt in PROMPTS:
        base = greedy_generate(bundle.model, prompt, 30)
        stream = prompt + base.tokens
        rng = random.Random(len(prompt))
        wrong = {i for i in range(len(stream)) if corrupt and rng.random() < 0.3}
        spec = mtp_greedy_generate(bundle.model, OracleDrafter(stream, vocab, wrong), prompt, 30, k=k)
        assert spec.tokens == base.tokens
        if not corrupt:
            assert spec.accepted == sum(spec.accepted_per_step)
            assert all(a == k for a in spec.accepted_per_step[:-1])
        else:
            assert 0 < spec.accepted < spec.drafted
            assert any(a < k for a in spec.accepted_per_step[:-1])


def test_mtp_decode_stops_at_eos_and_max_tokens(tiny):
    _, _, bundle = tiny
    prompt = PROMPTS[0]
    base = greedy_generate(bundle.model, prompt, 20)
    eos = base.tokens[7]
    stop = base.tokens.index(eos) + 1
    for drafter in (bundle.mtp, OracleDrafter(prompt + base.tokens, bundle.model.args.vocab_size)):
        spec = mtp_greedy_generate(bundle.model, drafter, prompt, 20, k=2, eos_token_ids=[eos])
        assert spec.tokens == base.tokens[:stop]
    assert mtp_greedy_generate(bundle.model, bundle.mtp, prompt, 1).tokens == base.tokens[:1]
    assert mtp_greedy_generate(bundle.model, bundle.mtp, prompt, 0).tokens == []
