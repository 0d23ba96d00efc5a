"""The prefix cache's second tier on disk (the host's ``--ssd-cache-dir`` / ``--ssd-cache-max-gb``).

A snapshot evicted from memory is written here whole (the attention KV of [0, L), not a delta on a
base: a file stands alone, so a reload reads one file and an eviction on disk never strands another
file), as one safetensors file whose metadata holds its token ids, kind and layout. A lookup that
finds a longer prefix here than in memory reads it back; the files survive a restart (the index is
rebuilt from their headers at start-up, without reading the arrays). Files live under
``DIR/mtp-routing/<model fingerprint>/`` so another model (or the host's own SSD cache in DIR) never
reads them; a file that does not parse is skipped with a warning. A salted request's snapshot keeps its space (a
digest of the salt, never the salt) in its metadata and its name, and is read back into that space only. Eviction
on disk is least-recently-used within the same retention classes as in memory, by bytes against the budget.

Writes and reads run on the thread that runs the text engine (a 4K-token snapshot of a 2B model is
~70 MB); they happen on an eviction and on a disk hit, never per token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from .snapshot import KVSegment, Snapshot
from .tree import Entry, PrefixTree

logger = logging.getLogger(__name__)

SUBDIR = "mtp-routing"
FORMAT = "1"
PARTIAL = ".partial.safetensors"  # a file being written (mx.save_safetensors adds ".safetensors" to a name without it)


@dataclass
class DiskRef:
    path: Path
    nbytes: int


def _header(path: Path) -> dict[str, str]:
    """The safetensors file's metadata, read from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 64 << 20:
            raise ValueError("header too large")
        return json.loads(f.read(n)).get("__metadata__", {})


def _encode(snap: Snapshot) -> tuple[dict[str, mx.array], list[Any]]:
    arrays: dict[str, mx.array] = {}
    layout: list[Any] = []
    for i, part in enumerate(snap.layers):
        if isinstance(part, KVSegment):
            if part.start != 0:
                raise ValueError("a disk snapshot holds its KV from position 0")
            if part.keys is not None:
                assert part.values is not None  # a segment holds keys and values, or neither
                arrays[f"l{i}.k"], arrays[f"l{i}.v"] = part.keys, part.values
            layout.append(["kv", part.end, part.keys is not None])
        else:
            for j, a in enumerate(part):
                arrays[f"l{i}.s{j}"] = a
            layout.append(["state", len(part)])
    head = None
    if snap.head is not None:
        head = []
        for j, kv in enumerate(snap.head):
            if kv.keys is not None:
                assert kv.values is not None  # a segment holds keys and values, or neither
                arrays[f"h{j}.k"], arrays[f"h{j}.v"] = kv.keys, kv.values
            head.append([kv.start, kv.end, kv.keys is not None])
        assert snap.head_hidden is not None  # a snapshot with the head's segments has its hidden state
        arrays["head_hidden"] = snap.head_hidden
    return arrays, [layout, head]


def _decode(arrays: dict[str, mx.array], layout: list[Any], head: list[Any] | None, length: int) -> Snapshot:
    layers: list[KVSegment | list[mx.array]] = []
    for i, spec in enumerate(layout):
        if spec[0] == "kv":
            layers.append(KVSegment(0, spec[1], arrays[f"l{i}.k"], arrays[f"l{i}.v"]) if spec[2] else KVSegment(0, spec[1], None, None))
        else:
            layers.append([arrays[f"l{i}.s{j}"] for j in range(spec[1])])
    heads = None
    if head is not None:
        heads = [KVSegment(s, e, arrays[f"h{j}.k"], arrays[f"h{j}.v"]) if has else KVSegment(s, e, None, None)
                 for j, (s, e, has) in enumerate(head)]
    return Snapshot(length, layers, heads, arrays.get("head_hidden") if heads is not None else None)


class DiskTier:
    def __init__(self, root: Path, budget_bytes: int, model_id: str) -> None:
        self.dir = Path(root) / SUBDIR / model_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = PrefixTree(budget_bytes)
        self.index.on_evict = self._delete
        self.written = self.loaded = self.write_errors = self.read_errors = 0
        self.write_s = self.read_s = 0.0
        self._scan()

    # -- the index ------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the files a previous run left, oldest first (so the newest are kept in budget)."""
        for tmp in self.dir.glob(f"*{PARTIAL}"):
            tmp.unlink(missing_ok=True)  # a write a crash interrupted
        files = sorted(self.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                meta = _header(path)
                if meta.get("format") != FORMAT:
                    raise ValueError(f"format {meta.get('format')!r}")
                tokens = [int(t) for t in meta["tokens"].split(",")]
                space = meta.get("space") or None  # files written before spaces are unsalted
                entry = self.index.insert(tokens, len(tokens), meta["kind"], DiskRef(path, path.stat().st_size), space=space)
                if entry is None:
                    path.unlink(missing_ok=True)  # over the budget (it shrank since the last run)
            except Exception as e:  # noqa: BLE001 - a foreign or damaged file is skipped, not fatal
                logger.warning("mtp-routing: prefix cache on disk: skipping %s (%s)", path.name, e)
        if len(self.index):
            logger.info("mtp-routing: prefix cache on disk: %d snapshots (%.1f MiB) from %s",
                        len(self.index), self.index.nbytes / 2**20, self.dir)

    def _delete(self, entry: Entry) -> None:
        entry.payload.path.unlink(missing_ok=True)

    def longest(self, tokens: Sequence[int], max_len: int, space: str | None = None) -> Entry | None:
        return self.index.longest(tokens, max_len, space=space) if max_len > 0 else None

    def has(self, tokens: Sequence[int], length: int, space: str | None = None) -> bool:
        return self.index.get(tokens, length, space) is not None

    # -- files ----------------------------------------------------------------------------------

    def save(self, tokens: Sequence[int], kind: str, snap: Snapshot, space: str | None = None) -> bool:
        """Write a whole snapshot of tokens[:snap.length] in ``space``; False when it is not kept."""
        prefix = list(tokens[: snap.length])
        if self.index.get(prefix, snap.length, space) is not None:
            self.index.insert(prefix, snap.length, kind, None, space=space)  # refresh (the payload is not replaced)
            return True
        tic = time.perf_counter()
        key = (space or "").encode() + struct.pack(f"<{len(prefix)}I", *prefix)
        name = hashlib.sha256(key).hexdigest()[:32] + ".safetensors"
        path = self.dir / name
        tmp = self.dir / (name + PARTIAL)
        try:
            arrays, (layout, head) = _encode(snap)
            meta = {"format": FORMAT, "kind": kind, "tokens": ",".join(map(str, prefix)),
                    "layout": json.dumps(layout), "head": json.dumps(head), "space": space or ""}
            mx.save_safetensors(str(tmp), arrays, metadata=meta)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a full or read-only disk loses the snapshot, nothing else
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            logger.warning("mtp-routing: prefix cache on disk: could not write a %d-token snapshot (%s)", snap.length, e)
            return False
        entry = self.index.insert(prefix, snap.length, kind, DiskRef(path, path.stat().st_size), space=space)
        if entry is None:
            path.unlink(missing_ok=True)
            return False
        self.written += 1
        self.write_s += time.perf_counter() - tic
        return True

    def load(self, entry: Entry) -> Snapshot | None:
        """The snapshot of an index entry, or None (the file is gone or damaged: the entry is dropped)."""
        tic = time.perf_counter()
        path = entry.payload.path
        try:
            arrays, meta = cast("tuple[dict[str, mx.array], dict[str, str]]", mx.load(str(path), return_metadata=True))
            snap = _decode(arrays, json.loads(meta["layout"]), json.loads(meta["head"]), entry.length)
            mx.eval(snap.arrays())
        except Exception as e:  # noqa: BLE001 - the request prefills instead
            self.read_errors += 1
            logger.warning("mtp-routing: prefix cache on disk: could not read %s (%s)", path.name, e)
            self.index.drop(entry)
            return None
        self.index.touch(entry)
        self.loaded += 1
        self.read_s += time.perf_counter() - tic
        return snap

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "dir": str(self.dir),
            "entries": len(self.index),
            "bytes": self.index.nbytes,
            "budget_bytes": self.index.budget_bytes,
            "written": self.written,
            "loaded": self.loaded,
            "evictions": self.index.stats.evictions,
            "write_errors": self.write_errors,
            "read_errors": self.read_errors,
            "write_s": round(self.write_s, 3),
            "read_s": round(self.read_s, 3),
        }
