"""Bundled demo data: a GPT-2 tokenizer, a small sample of agent traces and the
built-in tiny policy (a Hugging Face model folder, ``policy/``).

This module knows where the packaged files are and how they are compressed; it does
not know the trace format (`war.spec.traces`) or anything about speculation.
Files are read through `importlib.resources`, so they work from a wheel as well as
from a source checkout. See README.md in this folder for origins and licenses.
"""

from __future__ import annotations

import gzip
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path, PurePosixPath

__all__ = [
    "GPT2_TOKENIZER",
    "POLICY",
    "SAMPLE_TRACES",
    "Traversable",
    "gpt2_tokenizer_json",
    "policy_path",
    "resource",
]

GPT2_TOKENIZER = "gpt2-tokenizer.json.gz"
SAMPLE_TRACES = "sample_traces.jsonl.gz"
POLICY = "policy"


def resource(name: str) -> Traversable:
    """The packaged file `name` (for example `SAMPLE_TRACES`); raises FileNotFoundError."""
    # an absolute name or one with '..' would leave the package (joinpath follows it)
    parts = PurePosixPath(str(name).replace("\\", "/")).parts
    if not parts or parts[0] == "/" or ".." in parts:
        raise FileNotFoundError(f"war.data has no bundled file {name!r}")
    path = files(__name__).joinpath(name)
    if not path.is_file():
        raise FileNotFoundError(f"war.data has no bundled file {name!r}")
    return path


def gpt2_tokenizer_json() -> str:
    """The bundled GPT-2 `tokenizer.json`, decompressed (for `Tokenizer.from_str`)."""
    return gzip.decompress(resource(GPT2_TOKENIZER).read_bytes()).decode("utf-8")


def policy_path() -> Path:
    """The folder of the built-in policy (``config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json``), made by ``war train-policy``;
    raises FileNotFoundError if it is not installed."""
    folder = Path(str(files(__name__).joinpath(POLICY)))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"war.data has no built-in policy in {folder}")
    return folder
