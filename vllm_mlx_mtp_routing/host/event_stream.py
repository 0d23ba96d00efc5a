"""A generation event stream on its way out, in its client's protocol (vllm-mlx 0.6.0's ``_disconnect_guard``).

While no output comes (a queue wait, a long prefill) the host's guard writes an SSE comment every 5 s
(``: heartbeat``): OpenAI clients keep it; on an Anthropic stream it becomes the ``ping`` event Anthropic's API
sends, which Anthropic clients read as a sign of life where a comment is not one.

The guard also ends a stream that had no output for the host's ``--timeout`` (or the body's ``timeout``) by
just stopping: no error, no terminal frame, a silent end clients read as a complete (empty) answer. A stream
that ends without its terminal frame (``data: [DONE]``, Anthropic ``message_stop``) gets an error frame and
the terminal here: OpenAI ``data: {"error": ...}`` then ``[DONE]``, Anthropic ``event: error`` then
``message_stop``, as the host writes an error raised inside a stream.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from . import engine_access

logger = logging.getLogger("vllm_mlx_mtp_routing.bridge")

Message = dict[str, Any]

ANTHROPIC_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
HEARTBEAT = b": heartbeat\n\n"
PING = b'event: ping\ndata: {"type": "ping"}\n\n'
# A Responses stream ends with response.completed whatever its status (vllm-mlx 0.6.0 _responses_sse_event).
_TERMINALS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed", b"event: response.failed")
_TIMEOUT_STATUS = 504
# The guard's clock starts before the first chunk reaches the client: a timeout is told from a hang-up with margin.
_TIMEOUT_SLACK_S = 0.5


class EventStream:
    """One 200 event-stream response: its heartbeats in its protocol, and never a silent end."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.anthropic = path == ANTHROPIC_PATH
        self.responses = path == RESPONSES_PATH  # the Responses API's events
        self._body = body  # the request's JSON: its own ``timeout``, if any
        self._ended = False  # its terminal frame went out
        self._last_data = time.monotonic()  # when the host last wrote a frame that was not a heartbeat

    def arrived(self, message: Message) -> None:
        """The host wrote ``message`` (it may be held before it goes out)."""
        body = message.get("body", b"")
        if body and body != HEARTBEAT:
            self._last_data = time.monotonic()

    def outgoing(self, message: Message) -> list[Message]:
        """What goes to the client for one ``http.response.body`` message of the stream."""
        body = message.get("body", b"")
        if body == HEARTBEAT:
            return [{**message, "body": PING}] if self.anthropic else [message]
        if any(t in body for t in _TERMINALS):
            self._ended = True
        if message.get("more_body", False) or self._ended:
            return [message]
        self._ended = True
        return [{"type": "http.response.body", "body": self._error_and_terminal(), "more_body": True}, message]

    def _error_and_terminal(self) -> bytes:
        timeout = engine_access.request_timeout(self._body)
        idle = time.monotonic() - self._last_data
        if timeout is not None and idle >= timeout - _TIMEOUT_SLACK_S:
            status, kind = _TIMEOUT_STATUS, "timeout_error"
            message = (f"no output for {idle:.1f} s: the server's request timeout ({timeout:g} s) ended the stream "
                       "before the response completed")
            logger.warning("A stream had no output for %.1f s and was ended by the host's timeout (%g s): error frame sent",
                           idle, timeout)
        else:  # the client hung up (nobody reads this), or the host's stream stopped short
            status, kind, message = 500, "api_error", "the stream ended before the response completed"
        return error_and_terminal(self.anthropic, self.responses, status, kind, message)


def error_and_terminal(anthropic: bool, responses: bool, status: int, kind: str, message: str) -> bytes:
    """An error event and the stream's terminal frame, in the stream's protocol (as vllm-mlx 0.6.0 writes an error
    raised inside a stream): OpenAI ``data: {"error": ...}`` then ``[DONE]``, Anthropic ``event: error`` then
    ``message_stop``, Responses ``event: error``."""
    if anthropic:
        error = {"type": "error", "error": {"type": kind, "message": message}}
        stop = {"type": "message_stop"}
        return f"event: error\ndata: {json.dumps(error)}\n\nevent: message_stop\ndata: {json.dumps(stop)}\n\n".encode()
    if responses:
        event = {"type": "error", "code": kind, "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    frame = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return f"data: {json.dumps(frame)}\n\ndata: [DONE]\n\n".encode()
