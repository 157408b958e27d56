"""Reading and writing models in the Hugging Face folder layout, and random models for tests.

Knows: a model folder is ``config.json`` plus ``*.safetensors`` (one file, or shards
listed by ``model.safetensors.index.json``); tensor names and shapes are checked
before any weight is read, one tensor is in host memory at a time, and tied
embeddings have no ``lm_head.weight``. Writes ``config.json`` + ``model.safetensors``
that transformers' ``AutoModelForCausalLM`` loads. Does not know tokenizers,
generation settings, quantised formats, nor where folders come from (no downloads).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from war.engine.model import CausalLM
from war.engine.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must map tensor names to file names, "
                             f"got {type(weight_map).__name__}")
        bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise ValueError(f"{index}: weight_map[{bad!r}] must be a file name, "
                             f"got {weight_map[bad]!r}")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


@contextlib.contextmanager
def _open(file: Path, device: str | None = None) -> Iterator[Any]:
    """``safe_open``, whose errors (a plain ``Exception`` subclass) become ``ValueError``s
    naming the file: a corrupt or truncated file is bad input, not a server fault."""
    kwargs = {} if device is None else {"device": device}
    try:
        with safe_open(str(file), framework="pt", **kwargs) as h:
            yield h
    except SafetensorError as e:
        raise ValueError(f"{file} is not a valid safetensors file: {e}") from e


def torch_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` this process can use; ValueError naming it when
    torch does not know it (``"gpu"``), or it is a CUDA or MPS device this torch build or
    machine does not have (a CPU-only build has no ``"cuda"``; ``"cuda:3"`` on a machine
    with two GPUs), rather than a RuntimeError or AssertionError from deep inside torch
    once a model is being built."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch build or machine has no CUDA "
                             "device (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA "
                             "device(s) here")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"device {device!r}: WAR runs on cpu, cuda or mps devices")
    return dev


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> CausalLM:
    """Build the model described by ``folder/config.json`` and load its weights.

    Raises ``FileNotFoundError`` for a missing folder, config or weight file, and
    ``ValueError`` for a device this process cannot use (``torch_device``), an
    unsupported config, a malformed index or safetensors file,
    or missing, unexpected, repeated or wrongly shaped tensors (checked before any
    weight is read). The model is new: nothing existing is changed when this raises.
    """
    device = torch_device(device)
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"model folder {root} does not exist")
    config = ModelConfig.from_file(root / "config.json")
    files = _weight_files(root)
    shapes: dict[str, list[int]] = {}
    for f in files:
        with _open(f) as h:
            for name in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in shapes:
                    raise ValueError(f"tensor {name} appears in more than one file ({f.name})")
                shapes[name] = list(h.get_slice(name).get_shape())
    model = CausalLM(config, dtype=dtype, device="meta")
    try:
        skip = model.check_weights(shapes)
    except ValueError as e:
        raise ValueError(f"{root}: {e}") from e
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for f in files:
            with _open(f, device="cpu") as h:
                for name in h.keys():  # noqa: SIM118
                    if name not in skip:
                        params[name].copy_(h.get_tensor(name))
    return model.eval()


def save_model(model: CausalLM, folder: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (HF layout) into ``folder``."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    dtype_name = str(model.dtype).removeprefix("torch.")
    config["torch_dtype"] = dtype_name
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})


def init_random(config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", std: float = 0.02) -> CausalLM:
    """A model with seeded random weights (same seed: same weights in every dtype).

    Matrices and biases are normal with ``std``; norm weights are ``1 + N(0, 0.1)``
    so that they are not the identity.
    """
    if std <= 0:
        raise ValueError(f"std must be > 0, got {std}")
    model = CausalLM(config, dtype=dtype, device="meta")
    model.to_empty(device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.eval()
