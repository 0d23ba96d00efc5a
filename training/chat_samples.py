"""Chat samples for the tiny model's chat fine-tune, built from the standard library's source.

A sample is a conversation rendered by the checkpoint's own chat template (tools included as agents send them,
the template's thinking prefix when it adds one) and the assistant reply the model is taught to write: a short
block of stdlib code (2-5 lines of at most 72 characters, no blank line inside, dedented) that ends where the source file has a blank line,
then ``\\n\\n`` and ``<|im_end|>``. The blank line is the cue a tiny model can learn: code modelling already
predicts it where a block ends, and in an assistant turn it is always followed by the end of the turn.

System prompts (0-3000 tokens of varied prose and code), tool definitions (OpenAI function JSON synthesized from
stdlib ``def`` lines, 0-40 of them) and 1-3 turns vary per sample; files are split train / held out by
train_tiny_qwen35.is_heldout, so an evaluation can use conversations built from files never trained on.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPLY_LINES = 5  # a reply's most lines
REPLY_LINE_CHARS = 72  # a reply line's most characters
DEF_RE = re.compile(r"^\s*def ([A-Za-z_]\w*)\(([^)]*)\)")
AGENT_NAMES = ("a coding agent", "an interactive CLI agent", "a software engineering assistant", "a code assistant",
               "a helpful assistant")
ASKS = (
    "Show me the code in {mod} that uses `{ident}`.",
    "What does `{ident}` do in {mod}? Answer with the code.",
    "Write the lines of {mod} around `{ident}`.",
    "How is `{ident}` handled in {mod}.py?",
    "Fix the part of {mod} that computes `{ident}`.",
    "{ident}",
    "In {mod}: {ident}?",
    "Please look at {mod}.py and tell me about {ident}. Keep it short.",
)


@dataclass
class SourceFile:
    module: str
    lines: list[str]
    blocks: list[tuple[int, int]]  # [start, end): the last 2-5 lines of runs of non-blank lines ended by a blank line
    defs: list[tuple[str, list[str], str]]  # (name, argument names, a nearby line as its description)


def _blocks(lines: list[str]) -> list[tuple[int, int]]:
    out = []
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].strip():
            j += 1
        # a run ended by a blank line (not by the end of the file); its last lines are a reply
        if j < len(lines) and j - i >= 2:
            out.append((max(i, j - REPLY_LINES), j))
        i = j
    return out


def load_sources(stdlib: Path, heldout: bool, max_files: int | None = None) -> list[SourceFile]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_tiny_qwen35 import is_heldout, stdlib_files

    out = []
    for f in stdlib_files(stdlib):
        rel = str(f.relative_to(stdlib))
        if is_heldout(rel) != heldout:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines = [ln.rstrip() for ln in text.splitlines() if len(ln) <= 100]
        # replies have short lines: a long line in an assistant turn is where greedy decoding loops
        blocks = [(s, e) for s, e in _blocks(lines)
                  if all(ln.isascii() and len(ln) <= REPLY_LINE_CHARS for ln in lines[s:e])]
        if not blocks:
            continue
        defs = []
        for k, ln in enumerate(lines):
            m = DEF_RE.match(ln)
            if m:
                args = [a.split(":")[0].split("=")[0].strip(" *") for a in m.group(2).split(",")]
                args = [a for a in args if a and a not in ("self", "cls", "/")]
                desc = next((x.strip().strip("\"'") for x in lines[k + 1 : k + 4] if x.strip()), m.group(1))
                defs.append((m.group(1), args[:6], desc[:120]))
        out.append(SourceFile(module=Path(rel).with_suffix("").as_posix().replace("/", "."), lines=lines,
                              blocks=blocks, defs=defs))
        if max_files is not None and len(out) >= max_files:
            break
    return out


def _reply(rng: np.random.Generator, src: SourceFile) -> str:
    s, e = src.blocks[int(rng.integers(len(src.blocks)))]
    # 2-5 lines ending at the block's end: short replies make the blank line likely enough for greedy decoding
    s = max(s, e - int(rng.integers(2, REPLY_LINES + 1)))
    return textwrap.dedent("\n".join(src.lines[s:e]))


def _ident(rng: np.random.Generator, code: str) -> str:
    words = re.findall(r"[A-Za-z_][A-Za-z_0-9]{2,}", code)
    return str(rng.choice(words)) if words else "this"


def _user_text(rng: np.random.Generator, src: SourceFile, reply: str, sources: list[SourceFile]) -> str:
    ask = str(rng.choice(ASKS)).format(mod=src.module, ident=_ident(rng, reply))
    if rng.random() < 0.3:  # a pasted snippet from another file
        other = sources[int(rng.integers(len(sources)))]
        ask = f"{ask}\n\n```python\n{_reply(rng, other)}\n```"
    return ask


def _prose(rng: np.random.Generator, sources: list[SourceFile], n_lines: int) -> str:
    src = sources[int(rng.integers(len(sources)))]
    s = int(rng.integers(0, max(1, len(src.lines) - n_lines)))
    return "\n".join(src.lines[s : s + n_lines])


def _system(rng: np.random.Generator, sources: list[SourceFile], max_parts: int) -> str:
    head = f"You are {rng.choice(AGENT_NAMES)}. Help the user with their code. Be brief."
    parts = [head]
    for _ in range(int(rng.integers(0, max_parts + 1))):
        parts.append(_prose(rng, sources, int(rng.integers(3, 60))))
    return "\n\n".join(parts)


def _tools(rng: np.random.Generator, sources: list[SourceFile], n: int) -> list[dict[str, Any]]:
    tools = []
    while len(tools) < n:
        src = sources[int(rng.integers(len(sources)))]
        if not src.defs:
            continue
        name, args, desc = src.defs[int(rng.integers(len(src.defs)))]
        props = {a: {"type": str(rng.choice(["string", "integer", "boolean", "array"])),
                     "description": f"The {a} argument of {name}"} for a in args}
        params: dict[str, Any] = {"type": "object", "properties": props, "required": args[: int(rng.integers(0, 1 + len(args)))]}
        if rng.random() < 0.5:
            params["additionalProperties"] = False
        if rng.random() < 0.3:
            params["$schema"] = "http://json-schema.org/draft-07/schema#"
        tools.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    return tools


@dataclass
class ChatSample:
    prompt: list[int]  # what the server tokenizes: the template with its generation prompt
    reply: list[int]  # what the model writes, <|im_end|> included
    enable_thinking: bool


def build_sample(rng: np.random.Generator, tokenizer: Any, sources: list[SourceFile], max_tools: int = 40,
                 max_parts: int = 5, long_system: bool = False) -> ChatSample:
    """A conversation with up to ``max_parts`` pieces of prose in its system prompt and up to ``max_tools`` tools
    (``long_system``: both always present)."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.85 or long_system:
        messages.append({"role": "system", "content": _system(rng, sources, max_parts)})
    tools = None
    if rng.random() < 0.6 or long_system:
        tools = _tools(rng, sources, int(rng.integers(1, max_tools + 1)))
    for _ in range(int(rng.integers(0, 3))):  # earlier turns, rendered without a thinking block
        src = sources[int(rng.integers(len(sources)))]
        r = _reply(rng, src)
        messages.append({"role": "user", "content": _user_text(rng, src, r, sources)})
        messages.append({"role": "assistant", "content": r})
    src = sources[int(rng.integers(len(sources)))]
    reply = _reply(rng, src)
    messages.append({"role": "user", "content": _user_text(rng, src, reply, sources)})
    thinking = bool(rng.random() < 0.7)
    kw: dict[str, Any] = {} if thinking else {"enable_thinking": False}
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kw)
    # the template opens "<think>\n" (thinking) or writes an empty thinking block; the reply closes it if open
    body = ("\n</think>\n\n" if text.endswith("<think>\n") else "") + reply + "\n\n"
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(body, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return ChatSample(prompt=prompt, reply=ids, enable_thinking=thinking)


def long_agent_messages(rng: np.random.Generator, sources: list[SourceFile], tokenizer: Any, target_tokens: int,
                        replay: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An agent-like first request of about ``target_tokens``: a long system prompt and many tools, then one user
    message (a recorded agent request's system text, tools and user message first, where one is given)."""
    system = [f"You are {rng.choice(AGENT_NAMES)}. Help the user with their code. Be brief."]
    tools: list[dict[str, Any]] = []
    user = "What does add(2, 3) in calc.py return?"
    if replay is not None:
        system.insert(0, replay["system"])
        tools.extend(replay["tools"])
        user = replay["user"] or user
    while True:
        msgs = [{"role": "system", "content": "\n\n".join(system)}, {"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n >= target_tokens:
            return msgs, tools
        if rng.random() < 0.5:
            tools.extend(_tools(rng, sources, 4))
        else:
            system.append(_prose(rng, sources, 40))
