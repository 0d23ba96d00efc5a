"""Arms an import hook for ``vllm_mlx.cli`` so the stock ``vllm-mlx`` command learns ``--plugins``.

Imported from a one-line ``.pth`` at every interpreter start (as coverage and ddtrace do), so it does
nothing else: no vllm_mlx, pluggy or entry-point import until ``vllm_mlx.cli`` itself is imported,
and any failure leaves the host running as stock.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "vllm_mlx.cli"


class _CliLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _quiet_if_requested()  # the host's CLI imports transformers, which warns at import
        self._loader.exec_module(module)
        try:
            from . import bridge
        except Exception as exc:  # a broken install of ours must not break a plain vllm-mlx run
            _report_if_requested(exc)
            return
        bridge.attach_cli(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _CliFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CliLoader(spec.loader)
        return spec


_FINDER = _CliFinder()


def install() -> None:
    if TARGET in sys.modules or any(isinstance(f, _CliFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _CliFinder)]


def plugins_requested(argv: list[str], environ: Any) -> bool:
    """A ``serve`` that names plugins (flag or environment): it must not start without them."""
    return "serve" in argv and (bool(environ.get("VLLM_MLX_PLUGINS", "").strip()) or any(a.startswith("--plugins") for a in argv))


def _quiet_if_requested() -> None:
    import os

    if plugins_requested(sys.argv, os.environ):
        try:
            from . import quiet_startup

            quiet_startup.install()
        except Exception:  # a quieter log is not worth a failed start
            pass


def _report_if_requested(exc: BaseException) -> None:
    # Silent for plain runs; a server asked for plugins must not start as a stock one.
    import os

    if plugins_requested(sys.argv, os.environ):
        message = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        print(f"vllm-mlx: error: plugins requested but the plugin bridge cannot be imported: {message}", file=sys.stderr)
        raise SystemExit(1)
