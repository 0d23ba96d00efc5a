"""The host's own access checks (its API key, its rate limit) for a request the plugin answers before the host's
handler runs: a client without the key gets the host's 401, not a 400 about its body.

vllm-mlx 0.6.0 internals, read at call time: ``server.security`` (the bearer scheme), ``server.verify_api_key`` and
``server.check_rate_limit``, the dependencies of every generation route.
"""

from __future__ import annotations

from typing import Any

from .asgi import Scope


async def refusal(scope: Scope) -> Any:
    """The host's ``HTTPException`` for this request (401, 429), or None when it may go on."""
    from fastapi import HTTPException
    from starlette.requests import Request
    from vllm_mlx import server

    request = Request(scope)
    try:
        await server.verify_api_key(await server.security(request))
        await server.check_rate_limit(request)
    except HTTPException as exc:
        return exc
    return None
