"""One render + one tokenization per text request: the same tokens and snapshot positions as rendering
and tokenizing each boundary's prefix again (real tokenizers, real Qwen3.5 chat templates)."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
from pathlib import Path

import pytest

from vllm_mlx_mtp_routing.prefix_cache.boundaries import common_tokens, snapshot_positions
from vllm_mlx_mtp_routing.prefix_cache.shared_tokens import SharedTokens, common_prefix_len, splits_at_added_tokens
from vllm_mlx_mtp_routing.routing.prompt_preparation import PromptPreparer, prepare_chat
from vllm_mlx_mtp_routing.routing.token_memo import TokenMemo

TRAINED = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen35-trained"
SYSTEM = "You are a careful assistant for a software team. Answer briefly and cite files by path. " * 4
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
LONG = "def parse(path):\n    return open(path).read().split('\\n')  # café, naïve, 東京 ✓\n" * 60


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module", params=["trained", "tiny"])
def tok(request, tiny_vlm_fp32):
    return _tokenizer(TRAINED if request.param == "trained" else tiny_vlm_fp32)


CASES = {
    "user": [{"role": "user", "content": LONG}],
    "system+user": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the config parser?"}],
    "long system": [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarize."}],
    "tool results": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Read src/config.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "src/config.py"}}}]},
        {"role": "tool", "content": LONG, "tool_call_id": "1"},
        {"role": "tool", "content": "second result", "tool_call_id": "1"},
    ],
    "assistant re-rendered without its think block": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "<think>\nLet me look.\n</think>\n\nIn src/config.py."},
        {"role": "user", "content": LONG},
    ],
    "special tokens in user text": [{"role": "user", "content": "quote <|im_end|> and <think> literally\n" + LONG[:500]}],
}


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_tokenization_gives_the_same_tokens_and_positions(tok, case, tools):
    messages = CASES[case]

    def render(m):
        return tok.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=True)

    def encode(s):
        return list(tok.encode(s, add_special_tokens=False))

    prompt = render(messages)
    ids = encode(prompt)
    before = snapshot_positions(render, encode, messages, prompt, ids)  # every boundary's prefix tokenized again
    encodes = []
    counting = copy.deepcopy(tok)
    original = counting.encode
    counting.encode = lambda s, **k: encodes.append(len(s)) or original(s, **k)
    got_ids, got = prepare_chat(counting, render, messages, positions=True)
    assert got_ids == ids
    assert got == before and got  # every case has at least the end-of-turn position
    # the boundaries re-encode only the text after the prompt's last added token before them
    assert splits_at_added_tokens(tok) and all(n < 64 for n in encodes), encodes


def test_shared_tokens_equals_a_full_encode_anywhere(tok):
    """Any text that agrees with the prompt up to any character, then goes on differently: cut on, inside and
    either side of every added token of the prompt (where SharedTokens splits), and anywhere between them."""
    messages = CASES["tool results"]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    encoding = tok(prompt, add_special_tokens=False)
    ids = list(encoding["input_ids"])

    def encode(s):
        return list(tok.encode(s, add_special_tokens=False))

    shared = SharedTokens(tok, prompt, ids, encoding, encode)
    rng = random.Random(0)
    tails = ["", "Alpha", " x", "\n\n", "<|im_end|>\n<|im_start|>user\n", "é", "<|im_", "ünï", "  \n"]
    spans = [encoding.token_to_chars(i) for i, t in enumerate(ids) if t in tok.added_tokens_decoder]
    assert len(spans) >= 10
    edges = {c + d for span in spans for c in (span.start, span.end) for d in (-1, 0, 1)}
    cuts = sorted({c for c in edges if 0 <= c <= len(prompt)} | {rng.randrange(len(prompt) + 1) for _ in range(40)}
                  | {0, len(prompt)})
    for c in cuts:
        for tail in rng.sample(tails, 2):
            text = prompt[:c] + tail
            assert shared(text) == common_tokens(encode(text), ids), (c, tail)


def test_a_tokenizer_that_may_match_across_the_cut_takes_the_full_encode(tok):
    other = copy.deepcopy(tok)
    other.add_tokens(["<|im_start|>user"])  # contains another added token
    assert not splits_at_added_tokens(other)
    messages = CASES["system+user"]

    def render(m):
        return other.apply_chat_template(m, tokenize=False, add_generation_prompt=True)

    prompt = render(messages)
    ids = list(other.encode(prompt, add_special_tokens=False))
    encode = lambda s: list(other.encode(s, add_special_tokens=False))  # noqa: E731
    assert prepare_chat(other, render, messages, positions=True) == (ids, snapshot_positions(render, encode, messages, prompt, ids))


def test_a_later_turn_tokenized_from_the_memo_equals_a_full_tokenization(tok):
    """Each prompt of a growing conversation (and variants of it that part from the last one anywhere, also inside
    an added token) tokenized through the memo: the same tokens and snapshot positions as tokenizing it whole, most of
    its tokens reused; another cache salt reuses nothing."""
    memo = TokenMemo(tok)

    def render(m):
        return tok.apply_chat_template(m, tools=TOOLS, tokenize=False, add_generation_prompt=True)

    def encode(s):
        return list(tok.encode(s, add_special_tokens=False))

    messages = list(CASES["system+user"])
    for turn in range(4):
        messages += [{"role": "assistant", "content": f"Reply {turn}: see src/mod{turn}.py, café ✓"},
                     {"role": "user", "content": f"Question {turn}: quote <|im_end|> literally? " + LONG[: 40 * turn]}]
        prompt = render(messages)
        ids = encode(prompt)
        before = memo.reused_tokens
        assert prepare_chat(tok, render, messages, positions=True, memo=memo) == (
            ids, snapshot_positions(render, encode, messages, prompt, ids))
        if turn:
            assert memo.reused_tokens - before > len(ids) // 2
    rng = random.Random(1)
    for c in sorted(rng.sample(range(len(prompt)), 30)) + [len(prompt)]:
        for tail in ("", "<|im_end|>", "x<|im_", "ünï"):
            text = prompt[:c] + tail
            got = memo.tokenize(text)
            assert got.ids == encode(text), (c, tail)
    salted = memo.reused_tokens
    assert memo.tokenize(prompt + "z", space="another salt").ids == encode(prompt + "z")
    assert memo.reused_tokens == salted


def test_common_prefix_len():
    for a, b in [("", ""), ("abc", "abd"), ("abc", "abc"), ("abc", "ab"), ("x" * 1000 + "a", "x" * 1000 + "b"), ("b", "a")]:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_len(a, b) == n == common_prefix_len(list(a), list(b))


def test_the_worker_tokenizer_never_meets_the_hosts_thread():
    """The worker prepares long prompts while another thread (the host's event loop, in the server) uses
    the host's tokenizer in the ways that take it mutably (padding, truncation): nothing fails and every
    prompt's tokens are right. The worker's tokenizer is a separate object, so this holds whatever the
    tokenizers version (older ones raise "Already borrowed" for one tokenizer used by two threads)."""
    host_tok = _tokenizer(TRAINED)
    preparer = PromptPreparer(host_tok)
    assert preparer.tokenizer is not host_tok and preparer.tokenizer._tokenizer is not host_tok._tokenizer
    texts = [f"request {i}: " + LONG * 3 for i in range(24)]
    expected = [list(host_tok.encode(t, add_special_tokens=False)) for t in texts]
    stop, errors = threading.Event(), []

    def host_load():
        k = 0
        while not stop.is_set():
            try:
                host_tok([LONG, "short"], padding=True, truncation=True, max_length=64 + k % 7)
                host_tok(LONG * 2, add_special_tokens=False)
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
            k += 1

    async def main():
        return await asyncio.gather(*(preparer.raw(t) for t in texts))

    worker = threading.Thread(target=host_load)
    worker.start()
    try:
        got = asyncio.run(main())
    finally:
        stop.set()
        worker.join()
        preparer.close()
    assert not errors, errors[:3]
    assert got == expected


def test_a_tokenizer_that_cannot_be_copied_keeps_preparation_on_the_loop(caplog):
    class Uncopyable:
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle 'Tokenizer' object")

    with caplog.at_level("WARNING"):
        assert PromptPreparer.create(Uncopyable()) is None
    assert "prepared on the event loop" in caplog.text and "cannot pickle" in caplog.text


def test_a_prompt_far_past_the_context_is_refused_counting_only_the_context(tok):
    """A prompt of many times the context in characters is counted slice by slice, and refused once the count passes
    the context: the work is the context's worth of tokens, whatever the body's size. Counting agrees with the full
    tokenization where it passes."""
    from vllm_mlx_mtp_routing.plugin_api.errors import RequestRejected
    from vllm_mlx_mtp_routing.routing.prompt_preparation import check_length

    context = 2000
    calls = []
    counting = copy.copy(tok)
    counting.encode = lambda text, **kw: calls.append(len(text)) or tok.encode(text, **kw)  # type: ignore[method-assign]
    huge = LONG * 2000  # ~9M characters
    with pytest.raises(RequestRejected) as refused:
        check_length(counting, huge, context)
    assert refused.value.status_code == 400 and "the model's context is 2000 tokens" in refused.value.message
    assert sum(calls) < 8 * context + (1 << 16)  # a slice or so past the context, not the 9M characters
    sparse = ("x" + " " * 40 + "\n") * 4000  # few tokens for its characters (long whitespace tokens): counted, fits
    n = len(tok.encode(sparse, add_special_tokens=False))
    assert len(sparse) > 8 * (n + 5)
    check_length(tok, sparse, n + 5)
    with pytest.raises(RequestRejected):
        check_length(tok, sparse, n // 2)
    check_length(tok, huge, None)  # no context known: nothing to check against
