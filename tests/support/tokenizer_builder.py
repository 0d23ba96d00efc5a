"""An offline Qwen3.5-style tokenizer for test checkpoints.

A byte-level BPE with Qwen's pre-tokenizer split, trained with the `tokenizers` library on
local text (Python's stdlib sources by default), followed by Qwen3.5's added tokens in their
real order, and a ChatML template with Qwen3.5's behaviour: it raises on a system message
that is not first, renders image/video content parts as vision placeholders, offers tools
in the system block, and opens a thinking block in the generation prompt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# Qwen2/3/3.5 pre-tokenizer split (the regex in Qwen's tokenizer.json).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5's added tokens, (content, special), in id order after the BPE vocabulary; the
# relative offsets (im_start = eot+1, vision_start = eot+9, image_pad = eot+12) match the
# real tokenizer.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
SPECIAL_TOKENS: tuple[str, ...] = tuple(t for t, special in ADDED_TOKENS if special)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# Qwen3.5's template semantics, written for these tests: a non-first system message
# raises, system content may not hold media, `reasoning_content` (or an inline
# <think>...</think>) is shown only for assistant turns after the last real user query,
# consecutive tool results share one user turn, and the generation prompt opens <think>
# unless enable_thinking is false.
CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- macro render_content(content, do_vision_count, is_system_content=false) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}
{%- if 'image' in item or 'image_url' in item or item.type == 'image' or item.type == 'image_url' -%}
{%- if is_system_content %}{{ raise_exception('System message cannot contain images.') }}{% endif -%}
{%- if do_vision_count %}{% set image_count.value = image_count.value + 1 %}{% endif -%}
{%- if add_vision_id %}{{ 'Picture ' ~ image_count.value ~ ': ' }}{% endif -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif 'video' in item or 'video_url' in item or item.type == 'video' or item.type == 'video_url' -%}
{%- if is_system_content %}{{ raise_exception('System message cannot contain videos.') }}{% endif -%}
{%- if do_vision_count %}{% set video_count.value = video_count.value + 1 %}{% endif -%}
{%- if add_vision_id %}{{ 'Video ' ~ video_count.value ~ ': ' }}{% endif -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in item -%}
{{- item.text -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is none or content is undefined -%}
{{- '' -}}
{%- else -%}
{{- raise_exception('Unexpected content type.') -}}
{%- endif -%}
{%- endmacro -%}
{%- if not messages -%}
{{- raise_exception('No messages provided.') -}}
{%- endif -%}
{%- if tools and tools is iterable and tools is not mapping -%}
{{- '<|im_start|>system\n' -}}
{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor -%}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' -}}
{%- if messages[0].role == 'system' -%}
{%- set system_content = render_content(messages[0].content, false, true) | trim -%}
{%- if system_content %}{{ '\n\n' + system_content }}{% endif -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + (render_content(messages[0].content, false, true) | trim) + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages | length - 1) -%}
{%- for message in messages[::-1] -%}
{%- set index = (messages | length - 1) - loop.index0 -%}
{%- if ns.multi_step_tool and message.role == 'user' -%}
{%- set query = render_content(message.content, false) | trim -%}
{%- if not (query.startswith('<tool_response>') and query.endswith('</tool_response>')) -%}
{%- set ns.multi_step_tool = false -%}
{%- set ns.last_query_index = index -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.multi_step_tool -%}
{{- raise_exception('No user query found in messages.') -}}
{%- endif -%}
{%- for message in messages -%}
{%- set content = render_content(message.content, true) | trim -%}
{%- if message.role == 'system' -%}
{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set reasoning_content = '' -%}
{%- if message.reasoning_content is string -%}
{%- set reasoning_content = message.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{%- set reasoning_content = reasoning_content | trim -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > ns.last_query_index -%}
{{- '<think>\n' + reasoning_content + '\n</think>\n\n' -}}
{%- endif -%}
{{- content -}}
{%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping -%}
{%- for tool_call in message.tool_calls -%}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif -%}
{%- if loop.first and not content %}{{ '<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- elif loop.first %}{{ '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- else %}{{ '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}{% endif -%}
{%- if tool_call.arguments is mapping -%}
{%- for args_name, args_value in tool_call.arguments.items() -%}
{{- '<parameter=' + args_name + '>\n' -}}
{{- (args_value | tojson if args_value is mapping or (args_value is iterable and args_value is not string) else args_value | string) + '\n</parameter>\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.previtem and loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}
{%- else -%}
{{- raise_exception('Unexpected message role.') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- else -%}
{{- '<think>\n' -}}
{%- endif -%}
{%- endif -%}"""  # noqa: E501 - the chat template, verbatim


def default_corpus() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


_SKIPPED_DIRS = ("site-packages", "tests")


def _python_files(root: Path) -> Iterator[Path]:
    """`sorted(root.rglob("*.py"))`, lazily and without entering skipped folders: the corpus is read only up to
    its size, and the stdlib folder may hold a large site-packages."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_dir() and not e.is_symlink():  # as rglob, which does not follow linked folders
            if e.name not in _SKIPPED_DIRS:
                yield from _python_files(root / e.name)
        elif e.name.endswith(".py"):
            yield root / e.name


def _corpus_texts(paths: list[Path], max_chars: int) -> Iterator[str]:
    total = 0
    for root in paths:
        # Sorted and filtered so that the same Python install trains the same merges.
        files = [root] if root.is_file() else _python_files(root)
        for f in files:
            if any(d in f.parts for d in _SKIPPED_DIRS) or "test" in f.name:
                continue
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            total += len(text)
            yield text
            if total >= max_chars:
                return


def _train_bpe(bpe_vocab: int, corpus: list[Path], corpus_bytes: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    byte_level = dict(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tok.decoder = decoders.ByteLevel(**byte_level)
    tok.post_processor = processors.ByteLevel(**byte_level)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus_texts(corpus, corpus_bytes), trainer=trainer)
    flags = dict(normalized=False, single_word=False, lstrip=False, rstrip=False)
    tok.add_tokens([AddedToken(t, special=s, **flags) for t, s in ADDED_TOKENS])
    return tok


def _token_entry(content: str, special: bool) -> dict:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"content": content, **flags, "special": special}


def _write_configs(out_dir: Path, ids: dict[str, int]) -> None:
    additional = [t for t in SPECIAL_TOKENS if t != PAD_TOKEN]
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): _token_entry(t, s) for t, s in ADDED_TOKENS},
        "additional_special_tokens": additional,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    # mlx-vlm's processors read chat_template.jinja; transformers reads either file.
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    special_map = {
        "additional_special_tokens": additional,
        "eos_token": {k: v for k, v in _token_entry(EOS_TOKEN, True).items() if k != "special"},
        "pad_token": {k: v for k, v in _token_entry(PAD_TOKEN, True).items() if k != "special"},
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def tokenizer_info(tokenizer_dir: Path) -> dict:
    """Sizes and ids of an existing tokenizer written by `build_tokenizer`."""
    data = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    base = len(data["model"]["vocab"])
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    missing = [t for t, _ in ADDED_TOKENS if t not in added]
    if missing:
        raise ValueError(f"{tokenizer_dir}/tokenizer.json lacks Qwen added tokens: {missing}")
    ids = {t: added[t] for t, _ in ADDED_TOKENS}
    return {
        "tokenizer_size": max(base - 1, *added.values()) + 1,
        "bpe_vocab": base,
        "special_ids": ids,
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "special_token_ids": sorted(ids[t] for t in SPECIAL_TOKENS),
    }


def build_tokenizer(
    out_dir: Path,
    *,
    bpe_vocab: int = 4000,
    corpus: list[Path] | None = None,
    corpus_bytes: int = 3_000_000,
) -> dict:
    """Train the BPE and write the tokenizer files into `out_dir`; returns `tokenizer_info`.

    `corpus` holds files or directories (directories contribute their *.py files); about
    `corpus_bytes` characters of it are read.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in (corpus or default_corpus())]
    tok = _train_bpe(bpe_vocab, paths, corpus_bytes)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t, _ in ADDED_TOKENS}
    _write_configs(out_dir, ids)
    info = tokenizer_info(out_dir)
    logger.debug("trained tokenizer: %d tokens (%d BPE) into %s", info["tokenizer_size"], info["bpe_vocab"], out_dir)
    return info


def copy_tokenizer(src_dir: Path, out_dir: Path) -> dict:
    """Copy the tokenizer files of an existing checkpoint; returns `tokenizer_info`."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src_dir / name).exists():
            shutil.copyfile(src_dir / name, out_dir / name)
    return tokenizer_info(out_dir)
