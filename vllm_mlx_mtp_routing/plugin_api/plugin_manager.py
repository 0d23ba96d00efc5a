"""Finding and loading plugins: entry points of group ``vllm_mlx.plugins``, only the ones asked for."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .plugin_names import ENV_VAR, parse_names, requested_names  # noqa: F401 (re-exported)


class PluginError(Exception):
    """A requested plugin cannot be used; the message is meant for the user as is."""


class UnknownPluginError(PluginError):
    def __init__(self, name: str, installed: list[str]) -> None:
        listing = ", ".join(installed) if installed else "none"
        super().__init__(f"unknown plugin {name!r} (installed plugins: {listing})")
        self.name = name
        self.installed = installed


class PluginImportError(PluginError):
    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"plugin {name!r} failed to load: {type(error).__name__}: {error}")
        self.name = name
        self.error = error


class UnknownHookError(PluginError):
    def __init__(self, name: str, hook: str, specs: list[str]) -> None:
        close = difflib.get_close_matches(hook, specs, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (hooks: {', '.join(specs)})"
        super().__init__(f"plugin {name!r} implements unknown hook {hook!r}{hint}")
        self.name = name
        self.hook = hook


@dataclass(frozen=True)
class LoadedPlugin:
    name: str
    module: str
    version: str | None


def installed_entry_points() -> dict[str, md.EntryPoint]:
    return {ep.name: ep for ep in md.entry_points(group=hookspecs.ENTRY_POINT_GROUP)}


def _version_of(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else None


def new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def load_plugins(names: list[str], pm: pluggy.PluginManager | None = None) -> tuple[pluggy.PluginManager, list[LoadedPlugin]]:
    """Load exactly ``names`` (an allowlist): unknown names and import failures raise ``PluginError``."""
    pm = pm or new_manager()
    available = installed_entry_points()
    for name in names:
        if name not in available:
            raise UnknownPluginError(name, sorted(available))
    loaded: list[LoadedPlugin] = []
    for name in names:
        ep = available[name]
        try:
            plugin: Any = ep.load()
            pm.register(plugin, name=name)
        except Exception as exc:  # a plugin's own bug: report it in one line, not a traceback wall
            raise PluginImportError(name, exc) from exc
        check_hook_names(pm, name, plugin)
        loaded.append(LoadedPlugin(name=name, module=ep.value, version=_version_of(ep)))
    return pm, loaded


def spec_names() -> list[str]:
    return sorted(n for n in vars(hookspecs) if n.startswith(hookspecs.HOOK_PREFIX))


def check_hook_names(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    """A misspelled hook would otherwise never be called, silently: refuse it at start-up.

    Catches both a decorated implementation that matches no spec (pluggy's ``check_pending``) and an
    undecorated function carrying the hook prefix (as pytest treats ``pytest_*`` names).
    """
    specs = spec_names()
    for attr in dir(plugin):
        if attr.startswith(hookspecs.HOOK_PREFIX) and callable(getattr(plugin, attr)) and attr not in specs:
            raise UnknownHookError(name, attr, specs)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        hook = next((h for h in dir(pm.hook) if not h.startswith("_") and h not in specs), str(exc))
        raise UnknownHookError(name, hook, specs) from exc


def register_module(pm: pluggy.PluginManager, module_name: str, name: str) -> None:
    """Register a core plugin that ships with the bridge (built on the same hooks)."""
    pm.register(importlib.import_module(module_name), name=name)
