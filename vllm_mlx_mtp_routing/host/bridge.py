"""The CLI half of the bridge: ``--plugins`` on the stock ``vllm-mlx serve`` of vllm-mlx 0.6.x.

vllm-mlx 0.6.0 has no plugin system. ``cli.main()`` looks ``create_parser`` and ``serve_command`` up
in its module at call time, so replacing those two module globals is the whole CLI integration (host
internals, vllm-mlx 0.6.0). A host that ships the hooks natively (``vllm_mlx.plugins``, from
``patches/vllm-mlx-0.6.0-plugin-hooks.patch``) is left alone: it discovers the same entry points.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

from .bridge_state import BridgeState

logger = logging.getLogger("vllm_mlx_mtp_routing.bridge")

PLUGINS_HELP = (
    "Comma-separated plugins to load from the 'vllm_mlx.plugins' entry-point group "
    "(also VLLM_MLX_PLUGINS). Only named plugins load."
)


STATE: BridgeState | None = None
SERVE_PARSER: argparse.ArgumentParser | None = None


def host_has_native_hooks() -> bool:
    try:
        return importlib.util.find_spec("vllm_mlx.plugins") is not None
    except (ImportError, ValueError):
        return False


def attach_cli(cli: ModuleType) -> None:
    """Wrap the host's parser factory and serve command. Never raises: the host must keep working."""
    try:
        if host_has_native_hooks() or getattr(cli, "_vllm_mlx_plugin_bridge", False):
            return
        create_parser = cli.create_parser
        serve_command = cli.serve_command
    except Exception:
        return

    def create_parser_with_plugins() -> argparse.ArgumentParser:
        parser = create_parser()
        _extend_parser(parser, sys.argv[1:])
        return parser

    def serve_command_with_plugins(args: argparse.Namespace) -> Any:
        global STATE
        if STATE is None:
            from ..plugin_api.plugin_names import parse_names

            names = parse_names(getattr(args, "plugins", None))
            if not names or SERVE_PARSER is None:
                return serve_command(args)
            if "serve" in sys.argv[1:]:
                # argparse accepts abbreviations (--plug) that the pre-scan of argv cannot see
                SERVE_PARSER.error("argument --plugins: spell the flag out in full as --plugins")
            # Plugins named only in the namespace: a program calling serve_command itself (the host's
            # own tests do). Load them now; their flags take their defaults.
            STATE = load_into_parser(SERVE_PARSER, names)
        args = with_plugin_defaults(STATE, args)
        _prepare_serve(STATE, args)
        return serve_command(args)

    cli.create_parser = create_parser_with_plugins  # type: ignore[attr-defined]
    cli.build_parser = create_parser_with_plugins  # type: ignore[attr-defined]
    cli.serve_command = serve_command_with_plugins  # type: ignore[attr-defined]
    cli._vllm_mlx_plugin_bridge = True  # type: ignore[attr-defined]


def serve_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser | None:
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get("serve")
            if isinstance(sub, argparse.ArgumentParser):
                return sub
    return None


def _extend_parser(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    global STATE, SERVE_PARSER
    serve = serve_subparser(parser)
    if serve is None or any("--plugins" in a.option_strings for a in serve._actions):
        return
    SERVE_PARSER = serve
    serve.add_argument("--plugins", default=os.environ.get("VLLM_MLX_PLUGINS"), metavar="NAME[,NAME...]", help=PLUGINS_HELP)
    if "serve" not in argv:
        return
    from ..plugin_api.plugin_names import requested_names

    if _empty_plugins_flag(argv):
        serve.error("argument --plugins: expected one or more plugin names (comma-separated), got ''")
    names = requested_names(argv)
    if not names:
        return  # stock behaviour: nothing imported, nothing scanned
    STATE = load_into_parser(serve, names)


def _empty_plugins_flag(argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        value = argv[i + 1] if arg == "--plugins" and i + 1 < len(argv) else arg.split("=", 1)[1] if arg.startswith("--plugins=") else None
        if value is not None and not value.replace(",", "").strip():
            return True
    return False


def load_into_parser(serve: argparse.ArgumentParser, names: list[str]) -> BridgeState:
    """Load the named plugins and let each add its flags; user errors exit like argparse does."""
    from ..plugin_api.plugin_manager import PluginImportError, UnknownHookError, UnknownPluginError, load_plugins

    try:
        pm, loaded = load_plugins(names)
    except UnknownPluginError as exc:
        serve.error(f"argument --plugins: {exc}")
    except (PluginImportError, UnknownHookError) as exc:
        serve.exit(1, f"{serve.prog}: error: {exc}\n")
    host_dests = {a.dest for a in serve._actions}
    for plugin in loaded:
        group = serve.add_argument_group(f"plugin {plugin.name}")
        call_plugin_hook(pm, "vllm_mlx_add_cli_args", plugin.name, parser=serve, group=group)
    defaults = {a.dest: a.default for a in serve._actions if a.dest not in host_dests and a.dest != argparse.SUPPRESS}
    return BridgeState(names=names, pm=pm, plugins=loaded, serve_parser=serve, plugin_defaults=defaults)


def call_plugin_hook(pm: Any, hook_name: str, plugin_name: str, **kwargs: Any) -> list[Any]:
    """Call one plugin's implementations of a hook, passing only the arguments each one takes."""
    results = []
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if impl.plugin_name == plugin_name:
            results.append(impl.function(**{a: kwargs[a] for a in impl.argnames}))
    return results


def with_plugin_defaults(state: BridgeState, args: Any) -> argparse.Namespace:
    """``args`` as a Namespace that has every plugin flag: absent ones take their defaults."""
    given = vars(args)
    missing = {k: v for k, v in state.plugin_defaults.items() if k not in given}
    return argparse.Namespace(**{**missing, **given}) if missing or not isinstance(args, argparse.Namespace) else args


def _prepare_serve(state: BridgeState, args: argparse.Namespace) -> None:
    from ..plugin_api.errors import FlagError
    from ..plugin_api.plugin_names import parse_names

    if not set(parse_names(getattr(args, "plugins", None))) <= set(state.names):
        state.serve_parser.error(
            f"argument --plugins: names {getattr(args, 'plugins', None)!r}, but the command line loaded "
            f"{','.join(state.names)!r}; name the plugins once, spelled out as --plugins"
        )
    state.args = args
    try:
        state.pm.hook.vllm_mlx_validate_args(args=args)
    except FlagError as exc:
        state.serve_parser.error(str(exc))
    from . import model_path

    # one line, not the host's three download attempts and a traceback
    why = model_path.problem(getattr(args, "model", None), os.environ, offline_flag=bool(getattr(args, "offline", False)))
    if why is not None:
        state.serve_parser.exit(2, f"{state.serve_parser.prog}: error: argument model: {why}\n")
    from . import server_hooks

    server_hooks.install(state)
    names = ", ".join(f"{p.name} {p.version or ''}".strip() for p in state.plugins)
    logger.info("Plugins loaded: %s", names)

