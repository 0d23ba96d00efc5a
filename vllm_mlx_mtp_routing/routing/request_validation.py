"""Request parameters checked before admission: a bad value is a 400 naming the field, never a fault
inside a step that the whole batch shares.

Checked on the JSON body as the client sent it (the host's request models drop or coerce some fields,
e.g. ``seed``), and on the options the engine receives for calls that do not come through HTTP.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..plugin_api.errors import RequestRejected
from ..text_engine.sampling import MAX_TOP_LOGPROBS

SEED_LIMIT = 2**64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_CACHE_SALT_CHARS = 256


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestRejected(400, f"{field} must be a finite number, got {value!r}")
    return float(value)


def _integer(field: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(400, f"{field} must be an integer, got {value!r}")
    return value


def _in_range(field: str, value: float, ok: bool, rule: str) -> None:
    if not ok:
        raise RequestRejected(400, f"{field} must be {rule}, got {value!r}")


def _seed(v: Any) -> None:
    n = _integer("seed", v)
    _in_range("seed", n, 0 <= n < SEED_LIMIT, "in [0, 2**64)")


def _temperature(v: Any) -> None:
    x = _number("temperature", v)
    _in_range("temperature", x, x >= 0, ">= 0")


def _top_p(v: Any) -> None:
    x = _number("top_p", v)
    _in_range("top_p", x, 0 < x <= 1, "in (0, 1]")


def _top_k(v: Any) -> None:
    n = _integer("top_k", v)
    _in_range("top_k", n, n >= -1, ">= -1 (0 or -1, as vLLM and SGLang write it: no limit)")


def _min_p(v: Any) -> None:
    x = _number("min_p", v)
    _in_range("min_p", x, 0 <= x <= 1, "in [0, 1]")


def _penalty(field: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        x = _number(field, v)
        _in_range(field, x, -2 <= x <= 2, "in [-2, 2]")

    return check


def _repetition_penalty(v: Any) -> None:
    x = _number("repetition_penalty", v)
    _in_range("repetition_penalty", x, x > 0, "> 0")


def _max_tokens(field: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        n = _integer(field, v)
        _in_range(field, n, n >= 1, ">= 1")

    return check


def _stop(field: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise RequestRejected(400, f"{field} must be a string or a list of strings, got {v!r}")
        if len(items) > MAX_STOP_STRINGS:
            raise RequestRejected(400, f"{field} may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise RequestRejected(400, f"{field} strings may be at most {MAX_STOP_CHARS} characters long")

    return check


def _cache_salt(v: Any) -> None:
    if not isinstance(v, str):
        raise RequestRejected(400, f"cache_salt must be a string, got {type(v).__name__}")
    if not 0 < len(v) <= MAX_CACHE_SALT_CHARS:
        raise RequestRejected(400, f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters long, got {len(v)}")


def _top_logprobs(v: Any) -> None:
    n = _integer("top_logprobs", v)
    _in_range("top_logprobs", n, 0 <= n <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")


def _timeout(v: Any) -> None:
    # vllm-mlx 0.6.0's per-request timeout (0: the server's --timeout): a negative one timed out at once, a 504
    x = _number("timeout", v)
    _in_range("timeout", x, x >= 0, ">= 0 (seconds; 0: the server's --timeout)")


CHECKS: dict[str, Callable[[Any], None]] = {
    "seed": _seed,
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _min_p,
    "frequency_penalty": _penalty("frequency_penalty"),
    "presence_penalty": _penalty("presence_penalty"),
    "repetition_penalty": _repetition_penalty,
    "max_tokens": _max_tokens("max_tokens"),
    "max_completion_tokens": _max_tokens("max_completion_tokens"),
    "max_output_tokens": _max_tokens("max_output_tokens"),  # /v1/responses
    "stop": _stop("stop"),
    "stop_sequences": _stop("stop_sequences"),
    "top_logprobs": _top_logprobs,
    "cache_salt": _cache_salt,
    "timeout": _timeout,
}


def validate_logit_bias(value: Any, vocab_size: int | None) -> None:
    """400 unless ``logit_bias`` maps token ids of the vocabulary to numbers in [-100, 100] (as OpenAI):
    an id outside it would index past the logits."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise RequestRejected(400, f"logit_bias must be an object mapping token ids to numbers, got {value!r}")
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestRejected(400, f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestRejected(400, f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
        x = _number(f"logit_bias[{key!r}]", bias)
        _in_range(f"logit_bias[{key!r}]", x, -100 <= x <= 100, "in [-100, 100]")


def body_sampling_options(method: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """What the host's request models drop that the text path serves: ``frequency_penalty`` and
    ``logprobs`` (chat: ``logprobs: true`` with ``top_logprobs: N``; completions: ``logprobs: N``)."""
    options: dict[str, Any] = {}
    if body.get("frequency_penalty") is not None:
        options["frequency_penalty"] = float(body["frequency_penalty"])
    logprobs = body.get("logprobs")
    if logprobs is None or logprobs is False:
        if body.get("top_logprobs"):
            raise RequestRejected(400, "top_logprobs needs logprobs: true")
        return options
    if method in ("chat", "stream_chat"):
        if logprobs is not True:
            raise RequestRejected(400, f"logprobs must be a boolean, got {logprobs!r}")
        options.update(logprobs=True, top_logprobs=int(body.get("top_logprobs") or 0))
    else:
        n = _integer("logprobs", logprobs)
        _in_range("logprobs", n, 0 <= n <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")
        options.update(logprobs=True, top_logprobs=n)
    return options


def validate_parameters(*sources: Mapping[str, Any]) -> None:
    """Raise RequestRejected(400) for the first out-of-range field in any source (None values are unset)."""
    for source in sources:
        for name, check in CHECKS.items():
            value = source.get(name)
            if value is not None:
                check(value)


def fit_to_context(prompt_tokens: int, max_tokens: int, context_tokens: int | None, *, strict: bool = False) -> int:
    """The max_tokens to run with, or RequestRejected(400) when the prompt alone cannot fit the model's context.

    A ``max_tokens`` that overflows the context is cut to what the prompt leaves, as vllm-mlx and mlx-lm's
    server do: the response ends with ``length`` when the context runs out. ``strict`` (an explicit
    ``max_tokens`` under ``--strict-max-tokens``) refuses the overflow instead, as vLLM does.
    """
    if not context_tokens:
        return max_tokens
    if prompt_tokens >= context_tokens:
        raise RequestRejected(
            400, f"prompt is {prompt_tokens} tokens; the model's context is {context_tokens} tokens (prompt + max_tokens must fit)"
        )
    room = context_tokens - prompt_tokens
    if max_tokens <= room:
        return max_tokens
    if strict:
        raise RequestRejected(
            400,
            f"max_tokens: prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
            f"of {context_tokens} tokens; max_tokens may be at most {room} for this prompt",
        )
    return room


def _data_url(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    for key in ("image_url", "input_image"):
        value = part.get(key)
        url = value.get("url") if isinstance(value, dict) else value
        if isinstance(url, str) and url.startswith("data:"):
            return url
    source = part.get("source")  # Anthropic image block
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    return None


def _image_ref(part: Any) -> str | None:
    """An image part's URL (chat ``image_url``, Responses ``input_image``, an Anthropic ``url`` source)."""
    if not isinstance(part, dict):
        return None
    for key in ("image_url", "input_image"):
        value = part.get(key)
        url = value.get("url") if isinstance(value, dict) else value
        if isinstance(url, str):
            return url
    source = part.get("source")
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    return None


def _inline_url(part: Any, where: str) -> str | None:
    """The part's image as a data URL to check, or None (none, or a remote URL the host fetches); RequestRejected
    for one the host's media path cannot read (vllm-mlx 0.6.0 takes http(s) URLs, data:image URLs and raw base64
    of over 100 characters, and answers anything else with a 500)."""
    url = _data_url(part)
    if url is not None:
        return url
    ref = _image_ref(part)
    if ref is None or ref.startswith(("http://", "https://")):
        return None
    if len(ref) > 100 and not ref.startswith("/"):
        return f"data:image;base64,{ref}"  # what the host takes it for
    raise RequestRejected(400, f"{where}: an image must be an http(s) URL or a data:image/...;base64 URL, got {ref[:40]!r}")


def validate_inline_images(messages: Any) -> None:
    """400 for an inline (data: URL or base64 block) image that does not decode, or an image reference that is
    neither a URL nor inline data, before the host's media path turns it into a 500. Remote URLs are the host's
    to fetch."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            url = _inline_url(part, where)
            if url is None:
                continue
            header, _, data = url.partition(",")
            if not header.endswith(";base64"):
                continue  # a percent-encoded data URL: rare for images, left to the host
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise RequestRejected(400, f"{where}: image data is not valid base64 ({exc})") from None
            if header.startswith("data:image"):
                from PIL import Image

                try:
                    with Image.open(io.BytesIO(raw)) as image:
                        image.verify()
                except Exception as exc:
                    raise RequestRejected(400, f"{where}: image data does not decode as an image ({exc})") from None
