"""Finding and loading plugins: entry points of group ``vllm_mlx.plugins``, only the ones asked for."""

from __future__ import annotations

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
        loaded.append(LoadedPlugin(name=name, module=ep.value, version=_version_of(ep)))
    return pm, loaded


def register_module(pm: pluggy.PluginManager, module_name: str, name: str) -> None:
    """Register a core plugin that ships with the bridge (built on the same hooks)."""
    pm.register(importlib.import_module(module_name), name=name)
