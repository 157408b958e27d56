"""A cheap content fingerprint of a model folder, so that a resumed run can tell whether
its trajectories were made by the same weights (``run_settings.json``).

Knows: which files of a Hugging Face folder decide what a policy samples (``config.json``,
the tokenizer and chat-template files, the safetensors index, and the ``*.safetensors``
weights) and how to fingerprint them without reading gigabytes: the small files whole;
of each weights file its name, size and header (the tensors' names, dtypes, shapes and
offsets), plus a bounded sample of its tensor bytes (the first bytes of every tensor, up
to ``TENSOR_SAMPLE_BYTES`` each and ``FILE_SAMPLE_BUDGET`` a file, and the file's last
``TAIL_BYTES``).

What it catches: any change of the config, tokenizer or template; a weights file added,
removed, renamed, resized or re-laid out (other tensors, dtypes or shapes); and an
in-place update of the weights with the same shapes (a new RL step's checkpoint written
over the old one), as long as it changes the first bytes of some tensor or the file's
tail, which any update of all the weights does. What it does not: an update that
changes only bytes past each tensor's sampled start (a few rows of an embedding, a
sparse edit of one tensor's middle), nor a file changed between the fingerprint and
the weights' loading (it is taken when the run starts). Modification times are not used:
a copy of the same folder elsewhere has the same fingerprint. Does not know how weights
are loaded (``war.engine.loader``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

FINGERPRINT_FORMAT = "war-model-fingerprint/1"
META_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "model.safetensors.index.json")
"""The small files of a folder read whole (those present)."""
TENSOR_SAMPLE_BYTES = 4096
FILE_SAMPLE_BUDGET = 8 * 1024 * 1024
MIN_TENSOR_SAMPLE = 64
TAIL_BYTES = 64 * 1024
_MAX_HEADER = 100 * 1024 * 1024  # (safetensors' own limit)


def model_fingerprint(folder: str | os.PathLike[str]) -> str | None:
    """``"sha256:<hex>"`` of the folder's config, tokenizer and weights (see the module's
    docstring for what it covers), or ``None`` when ``folder`` is not a folder or holds
    none of those files (nothing to fingerprint: the run's loading of the model says
    what is missing). Reads a bounded part of each weights file; raises nothing for a
    malformed one (its raw head and tail are fingerprinted instead)."""
    root = Path(folder)
    try:
        if not root.is_dir():
            return None
        weights = sorted(p for p in root.glob("*.safetensors") if p.is_file())
        meta = [root / name for name in META_FILES if (root / name).is_file()]
    except OSError:
        return None
    if not weights and not meta:
        return None
    digest = hashlib.sha256(FINGERPRINT_FORMAT.encode())
    try:
        for path in meta:
            data = path.read_bytes()
            _add(digest, "file", path.name, len(data), hashlib.sha256(data).hexdigest())
        for path in weights:
            _add_weights(digest, path)
    except OSError:  # (unreadable now: the model cannot be loaded either)
        return None
    return f"sha256:{digest.hexdigest()}"


def _add(digest: Any, *parts: object) -> None:
    digest.update(json.dumps(parts).encode() + b"\n")


def _add_weights(digest: Any, path: Path) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        _add(digest, "weights", path.name, size)
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        header = _header(f, length, size)
        if header is None:  # not a safetensors layout: its raw head (and tail, below)
            f.seek(0)
            _add(digest, "raw-head", hashlib.sha256(f.read(TAIL_BYTES)).hexdigest())
        else:
            header_hash, offsets = header
            _add(digest, "header", length, header_hash)
            data_start = 8 + length
            per_tensor = max(MIN_TENSOR_SAMPLE,
                             min(TENSOR_SAMPLE_BYTES, FILE_SAMPLE_BUDGET // max(1, len(offsets))))
            sample = hashlib.sha256()
            for begin, end in offsets:
                f.seek(data_start + begin)
                sample.update(f.read(min(per_tensor, end - begin)))
            _add(digest, "tensor-heads", per_tensor, sample.hexdigest())
        f.seek(max(0, size - TAIL_BYTES))
        _add(digest, "tail", hashlib.sha256(f.read(TAIL_BYTES)).hexdigest())


def _header(f: Any, length: int, size: int) -> tuple[str, list[tuple[int, int]]] | None:
    """The sha256 of a safetensors file's header JSON (read from ``f``, just past the
    8-byte length) and the sorted (begin, end) offsets of its tensors in the data
    section; ``None`` if the file does not hold a valid header."""
    if not 2 <= length <= min(_MAX_HEADER, size - 8):
        return None
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    offsets = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        spans = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(spans, list) or len(spans) != 2
                or not all(isinstance(x, int) and x >= 0 for x in spans) or spans[0] > spans[1]):
            return None
        offsets.append((spans[0], spans[1]))
    return hashlib.sha256(raw).hexdigest(), sorted(offsets)
