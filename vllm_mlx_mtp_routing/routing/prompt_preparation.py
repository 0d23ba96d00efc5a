"""A text request's prompt, prepared off the event loop: its tokens and its snapshot positions.

Tokenizing a long chat on the event loop is a pause that running streams and ``/health`` wait out, and placing
each snapshot boundary by tokenizing its prefix again would repeat that work per boundary.
Here the prompt is rendered once and tokenized once (``SharedTokens`` places the prefix cache's
boundaries from that one tokenization), on one worker thread; the event loop only awaits it.

The worker tokenizes with its own copy of the tokenizer: a Hugging Face fast tokenizer used by two
threads at once can fail (``RuntimeError: Already borrowed`` in tokenizers releases where
one thread changes padding or truncation), and the host tokenizes on the event loop. One worker thread keeps the copy to one thread and the requests in their arrival order. The
chat template is rendered on the worker too (Jinja only reads the host's processor).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..plugin_api.errors import RequestRejected
from ..prefix_cache.boundaries import snapshot_positions
from ..prefix_cache.shared_tokens import SharedTokens
from .image_memo import ImageMemo
from .token_memo import TokenMemo

logger = logging.getLogger("vllm_mlx_mtp_routing.routing")

Marks = list[tuple[int, str]]


# A prompt of at most this many characters per context token is tokenized at once; a longer one is first counted
# in slices, up to the context (real text averages 3-5 characters a token).
CHARS_PER_TOKEN_UNCOUNTED = 8
SLICE_CHARS = 1 << 16


def check_length(tokenizer: Any, prompt: str, context_tokens: int | None) -> None:
    """RequestRejected(400) for a prompt past the model's context, found by counting its tokens slice by slice and
    stopping there: tokenizing a body of tens of megabytes whole takes minutes and gigabytes (a 50 MB one: 26M
    tokens, 64 s and 11.7 GB in a Hugging Face fast tokenizer) only to be refused. Slices end at whitespace, where
    the tokenizers' pre-tokenizers split anyway."""
    if not context_tokens or len(prompt) <= CHARS_PER_TOKEN_UNCOUNTED * context_tokens:
        return
    counted = start = 0
    while start < len(prompt):
        end = min(start + SLICE_CHARS, len(prompt))
        if end < len(prompt):
            cut = max(prompt.rfind(" ", start, end), prompt.rfind("\n", start, end))
            end = cut if cut > start else end
        counted += len(tokenizer.encode(prompt[start:end], add_special_tokens=False))
        start = end
        if counted > context_tokens + start // SLICE_CHARS + 1:  # past any error a cut can make
            raise RequestRejected(
                400, f"prompt is at least {counted} tokens ({len(prompt)} characters); the model's context is "
                f"{context_tokens} tokens (prompt + max_tokens must fit)",
            )


def prepare_chat(
    tokenizer: Any, render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]], *, positions: bool,
    context_tokens: int | None = None, memo: TokenMemo | None = None, space: str | None = None,
) -> tuple[list[int], Marks]:
    """The prompt's tokens and, with ``positions``, where it is worth a prefix-cache snapshot; RequestRejected(400)
    for a prompt far past ``context_tokens`` (``check_length``). ``memo``: earlier prompts, whose tokens a prompt that
    repeats their text reuses (``TokenMemo``, the caller's thread's own), those of the same ``space`` (cache salt)."""
    prompt = render(messages)
    check_length(tokenizer, prompt, context_tokens)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    if memo is not None:
        tokenized = memo.tokenize(prompt, space)
        ids = tokenized.ids
        if not positions:
            return list(ids), []
        shared = SharedTokens.of_added(prompt, ids, tokenized.added_ends, tokenized.added_next, encode)
        return list(ids), snapshot_positions(render, encode, messages, prompt, ids, shared_tokens=shared)
    encoding = tokenizer(prompt, add_special_tokens=False)
    ids = list(encoding["input_ids"])
    if not positions:
        return ids, []
    shared = SharedTokens(tokenizer, prompt, ids, encoding, encode)
    return ids, snapshot_positions(render, encode, messages, prompt, ids, shared_tokens=shared)


def prepare_raw(tokenizer: Any, prompt: str, context_tokens: int | None = None) -> list[int]:
    check_length(tokenizer, prompt, context_tokens)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


class PromptPreparer:
    def __init__(self, tokenizer: Any, processor: Any = None) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)  # the worker's own (see the module's docstring)
        # The VLM's processor (media prompts), the worker's own copy too: it holds a tokenizer.
        self.processor = copy.deepcopy(processor) if processor is not None else None
        self.memo = TokenMemo(self.tokenizer)  # used on the worker thread only
        self.images = ImageMemo()  # likewise
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-prompt")

    @classmethod
    def create(cls, tokenizer: Any, processor: Any = None) -> PromptPreparer | None:
        """None (prompts prepared on the event loop, as before) when the tokenizer cannot be copied."""
        try:
            return cls(tokenizer, processor)
        except Exception as exc:
            logger.warning("Text prompts are prepared on the event loop: the tokenizer could not be copied for a worker (%s: %s)",
                           type(exc).__name__, exc)
            return None

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # A request cancelled while waiting leaves the worker to finish and drop the result.
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def chat(
        self, render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]], *, positions: bool,
        context_tokens: int | None = None, space: str | None = None,
    ) -> tuple[list[int], Marks]:
        return await self._run(prepare_chat, self.tokenizer, render, messages, positions=positions, context_tokens=context_tokens,
                               memo=self.memo, space=space)

    async def media(self, prepare: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``prepare(processor, *args, images=..., **kwargs)`` on the worker, with its copy of the processor and its
        memo of processed images."""
        return await self._run(prepare, self.processor, *args, images=self.images, **kwargs)

    async def raw(self, prompt: str, context_tokens: int | None = None) -> list[int]:
        return await self._run(prepare_raw, self.tokenizer, prompt, context_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
