"""A schema-based fuzz run against the real server, the host alone and the host + plugin, same seed: 5xx per endpoint.

Schemathesis (not a project requirement: `.venv/bin/pip install schemathesis`) generates requests from the host's own
OpenAPI schema, valid and invalid ones, for every operation it lists; /v1/messages and /v1/messages/count_tokens,
which that schema lists without a body, get the Anthropic request schema (lib/anthropic_messages_schema.json).
Every `model` field is the served model's name, and max_tokens fields are capped in the schema at 16 (the servers
at 64) so that valid requests generate briefly. Requests are sent one at a time and recorded (HAR); the table counts
each operation's requests, its 5xx answers other than 503, and its 503s (the host's answer for a feature that is not
installed: audio, MCP), then the plugin's counters (they must be back at 0).

    .venv/bin/python benchmarks/schema_fuzz.py [--model PATH] [--seed 20261127] [--examples 25] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from any directory
sys.path.insert(0, str(REPO / "tests"))  # the test support package: support.*
from support.server import serve  # noqa: E402

ANTHROPIC = REPO / "benchmarks" / "lib" / "anthropic_messages_schema.json"
BASE_FLAGS = ("--continuous-batching", "--mllm", "--max-num-seqs", "4", "--max-tokens", "64")
SETUPS = {"host": BASE_FLAGS, "plugin": ("--plugins", "mtp-routing", *BASE_FLAGS)}
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
PHASES = "examples,coverage,fuzzing"  # not stateful: its requests follow the responses, which differ between setups


def _cap(schema: Any) -> None:
    """Every max-tokens field at most 16 (in place)."""
    if isinstance(schema, dict):
        for name in MAX_TOKEN_FIELDS:
            field = schema.get("properties", {}).get(name)
            if isinstance(field, dict):
                for option in field.get("anyOf", [field]):
                    if option.get("type") == "integer":
                        option["maximum"] = 16
        for value in schema.values():
            _cap(value)
    elif isinstance(schema, list):
        for value in schema:
            _cap(value)


def patched_schema(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """The host's schema with the Anthropic bodies added, the served model's name in every `model` field and
    max-tokens fields capped."""
    spec = json.loads(json.dumps(spec))
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    anthropic = {k: v for k, v in json.loads(ANTHROPIC.read_text()).items() if not k.startswith("$")}
    schemas.update({f"Anthropic{k}": v for k, v in anthropic.items()})
    for path, ref in (("/v1/messages", "AnthropicMessagesRequest"), ("/v1/messages/count_tokens", "AnthropicCountTokensRequest")):
        spec["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}
    for schema in schemas.values():
        if "model" in schema.get("properties", {}):
            schema["properties"]["model"] = {"type": "string", "enum": [model]}
    _cap(schemas)
    return spec


def endpoint_of(url_path: str, templates: list[str]) -> str:
    for template in templates:
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), url_path):
            return template
    return url_path


def count(har: Path, spec: dict[str, Any]) -> dict[str, Counter[str]]:
    """{operation: Counter(requests, 500 (any 5xx but 503), 503)} from Schemathesis's HAR record; requests with a
    method the schema does not list for the path count under one row."""
    from urllib.parse import urlsplit

    templates = list(spec["paths"])
    counts: dict[str, Counter[str]] = {}
    for entry in json.loads(har.read_text())["log"]["entries"]:
        request, status = entry["request"], int(entry["response"]["status"])
        path = endpoint_of(urlsplit(request["url"]).path, templates)
        declared = request["method"].lower() in spec["paths"].get(path, {})
        c = counts.setdefault(f"{request['method']} {path}" if declared else "(methods a path does not list)", Counter())
        c["requests"] += 1
        c["503"] += status == 503
        c["500"] += status >= 500 and status != 503
    return counts


def run(setup: str, model: Path, seed: int, examples: int, out: Path) -> tuple[dict[str, Counter[str]], str]:
    schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    with serve(model, *SETUPS[setup], log_dir=out) as server:
        spec = patched_schema(server.get("/openapi.json").json(), server.model)
        schema_path = out / f"{setup}-schema.json"
        schema_path.write_text(json.dumps(spec, indent=1))
        har = out / f"{setup}.har"
        cmd = [schemathesis, "run", str(schema_path), "--url", server.url, "--seed", str(seed), "-n", str(examples),
               "--phases", PHASES, "--checks", "not_a_server_error", "--no-shrink", "--workers", "1",
               "--request-timeout", "120", "--report", "har", "--report-har-path", str(har), "--no-color",
               "--suppress-health-check", "all", "--continue-on-failure", "--generation-database", "none"]
        tic = time.monotonic()
        with open(out / f"{setup}-schemathesis.txt", "w") as log:
            # in the run's folder: Schemathesis keeps a cache of its own in the working directory
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=out)
        elapsed = time.monotonic() - tic
        alive = server.post("/v1/chat/completions", timeout=120, json={
            "model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}).status_code
        after = f"{setup}: {elapsed:.0f} s; a chat after the run: {alive}"
        if setup == "plugin":
            from support.plugin_status import counters

            after += f"; counters {counters(server)}"
    return count(har, spec), after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the tiny bf16 test model, built under --out")
    ap.add_argument("--seed", type=int, default=20261127)
    ap.add_argument("--examples", type=int, default=25, help="examples per operation in the fuzzing phase")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/tmp/schema-fuzz-<time>")
    ap.add_argument("--setups", default="host,plugin")
    a = ap.parse_args(argv)
    out = a.out or REPO / "benchmarks" / "results" / "tmp" / time.strftime("schema-fuzz-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        from support.tiny_model import tiny_model_dir

        model = tiny_model_dir(out / "models", "bfloat16")
    results, notes = {}, []
    for setup in a.setups.split(","):
        results[setup], note = run(setup, model, a.seed, a.examples, out)
        notes.append(note)
    endpoints = sorted({e for r in results.values() for e in r}, key=lambda e: e.split(" ", 1)[::-1])
    setups = list(results)

    def cells(c: Counter[str]) -> str:
        return f"{c['requests']} | {c['500']} | {c['503']}"

    print("| operation | " + " | ".join(f"{s} requests | {s} 5xx | {s} 503" for s in setups) + " |")
    print("|---|" + "---:|" * (3 * len(setups)))
    for e in endpoints:
        print(f"| `{e}` | " + " | ".join(cells(results[s].get(e, Counter())) for s in setups) + " |")
    print("| all | " + " | ".join(cells(sum(results[s].values(), Counter())) for s in setups) + " |")
    print("\n".join(notes))
    print(f"records: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
