"""What a router reads of a replica besides ``/health``: the served model's name.

sglang-router 0.3.2 asks each worker for ``GET /server_info`` (then ``/model_info``) when it registers it and takes
the worker's model from ``model_path``; vllm-mlx 0.6.0 has neither (404), and the router's own ``/v1/models`` then
lists one model named 'unknown'. vllm-router 0.1.17 proxies ``/v1/models`` to a worker instead. Open like
``/health``: the name is in the host's ``/health`` too.
"""

from __future__ import annotations

from typing import Any


def install(server: Any) -> None:
    """Add the routes to the host's app (vllm-mlx 0.6.0 ``server.app``; the name is its ``_model_name`` global)."""

    async def info() -> dict[str, Any]:
        name = getattr(server, "_model_name", None)
        return {"model_path": name, "tokenizer_path": name, "served_model_name": name, "is_generation": True}

    for path in ("/server_info", "/model_info"):
        server.app.add_api_route(path, info, methods=["GET"], include_in_schema=False)
