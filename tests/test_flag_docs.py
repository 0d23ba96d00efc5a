"""The flags' help in `vllm-mlx serve --plugins mtp-routing --help` and docs/configuration.md say the same thing."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vllm_mlx_mtp_routing.host.bridge import PLUGINS_HELP, load_into_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def doc_table(heading: str) -> dict[str, str]:
    """{flag: meaning} of the table under ``## heading``."""
    section = DOC.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if m := re.fullmatch(r"\| `(--[a-z0-9-]+)(?: [^`]*)?` \| (.*) \|", line):
            rows[m[1]] = m[2]
    return rows


def parser_help() -> dict[str, str]:
    """{flag: help as --help prints it, before wrapping} of the plugin's argument group, loaded as the CLI loads it."""
    parser = argparse.ArgumentParser(prog="vllm-mlx serve")
    load_into_parser(parser, ["mtp-routing"])
    [group] = [g for g in parser._action_groups if g.title == "plugin mtp-routing"]
    formatter = parser._get_formatter()
    return {a.option_strings[0]: formatter._expand_help(a) for a in group._group_actions}


def test_every_plugin_flag_is_documented_with_its_help_text() -> None:
    documented, helps = doc_table("The plugin's flags"), parser_help()
    assert sorted(documented) == sorted(helps), "docs/configuration.md and the parser name different flags"
    for flag, text in helps.items():
        assert documented[flag] == text, f"{flag}: the help and docs/configuration.md differ"


def test_the_plugins_flag_is_documented_with_its_help_text() -> None:
    assert doc_table("`--plugins`") == {"--plugins": PLUGINS_HELP}
