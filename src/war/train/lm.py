"""Training a small causal language model on a token stream.

Knows: next-token cross-entropy on random windows of one long token stream
(optionally only on the tokens a loss mask selects, and only on windows starting at
given positions, e.g. episode starts), AdamW with decoupled weight decay on
matrices only, a linear warmup followed by a cosine decay, gradient clipping, a
step or wall-clock budget, torch's CPU thread count, and the loss curve. Does not
know model architectures (a model is any ``torch.nn.Module`` with
``forward_dense(input_ids[B, T]) -> logits[B, T, V]``, or whose ``__call__`` does
that), tokenizers, files or evaluation beyond the training loss.

Reproducibility: with a step budget (``time_budget_s=None``) the same model
initialisation, token stream (with its loss mask and window starts) and config
give the same weights, bit for bit, when run with the same number of threads on
the same machine and torch build (the window positions come from a seeded numpy
generator; CPU kernels are deterministic for a fixed thread count, but their
reduction order depends on it). A time budget makes the number of steps, and so
the schedule and the weights, depend on the machine's speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F


def check_seed(name: str, seed: object) -> None:
    """ValueError unless ``seed`` is an int in [0, 2**63): numpy's generators take only
    non-negative seeds, torch's and the engine's at most 63 bits, so a bad one is refused
    when it is given rather than when the first batch is drawn."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {seed!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of ``train_lm``; validated on construction.

    * ``seq_len``: tokens per training window (the model sees ``seq_len`` inputs
      and predicts the next token of each).
    * ``batch_size``: windows per optimizer step.
    * ``steps``: optimizer steps; with ``time_budget_s`` it is the most steps and
      the schedule follows whichever budget runs out first.
    * ``time_budget_s``: wall-clock budget in seconds (``None``: steps only).
    * ``lr``: peak learning rate; ``min_lr_ratio``: the cosine's floor as a
      fraction of it; ``warmup_steps``: linear warmup from ``lr / warmup_steps``.
    * ``weight_decay``: AdamW's decoupled decay, applied to parameters with two or
      more dimensions (not to norms or biases); ``betas``, ``eps``: AdamW's.
    * ``grad_clip``: global gradient-norm clip (``None``: off).
    * ``seed``: of the window positions and of torch's global RNG during training
      (forked: the caller's RNG state is restored afterwards); in [0, 2**63).
    * ``threads``: torch CPU threads during training (``None``: unchanged).
    * ``autocast``: run the forward pass under ``torch.autocast`` in this dtype
      (``"bfloat16"``; ``None``: the model's dtype). Weights and optimizer state stay
      in the model's dtype; the loss is computed in float32.
    * ``log_every``: steps between loss-curve points (and ``log`` calls).
    """

    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1000
    time_budget_s: float | None = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    seed: int = 0
    threads: int | None = None
    autocast: str | None = None
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be an int >= 1 or None, got {self.threads!r}")
        if self.autocast not in (None, "bfloat16", "float16"):
            raise ValueError(
                f"autocast must be None, 'bfloat16' or 'float16', got {self.autocast!r}")
        check_seed("seed", self.seed)
        # the comparisons below would raise a TypeError naming nothing for a string
        for name in ("lr", "min_lr_ratio", "weight_decay", "eps", "time_budget_s", "grad_clip"):
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.betas, tuple) or not all(_is_number(b) for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.time_budget_s is not None and not (0.0 < self.time_budget_s < math.inf):
            raise ValueError(f"time_budget_s must be > 0 and finite, got {self.time_budget_s!r}")
        if not (0.0 < self.lr < math.inf):
            raise ValueError(f"lr must be > 0 and finite, got {self.lr!r}")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not (0.0 <= self.weight_decay < math.inf):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not (0.0 < self.eps < math.inf):
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if self.grad_clip is not None and not (0.0 < self.grad_clip < math.inf):
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    def lr_at(self, progress: float, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) at ``progress`` in
        [0, 1] of the budget: linear warmup over ``warmup_steps``, then a cosine
        from ``lr`` down to ``lr * min_lr_ratio``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        p = min(max(progress, 0.0), 1.0)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * p))


@dataclass(frozen=True)
class TrainLog:
    """One point of the loss curve: the mean loss of the steps since the last point."""

    step: int  # optimizer steps done
    loss: float  # mean training loss (nats per token) over the logged interval
    lr: float  # learning rate of the last step
    elapsed_s: float
    tokens: int  # training tokens seen so far


@dataclass(frozen=True)
class TrainResult:
    """What ``train_lm`` did: the steps it took and its loss curve."""

    steps: int
    tokens: int
    seconds: float
    first_loss: float  # loss of the first step
    final_loss: float  # mean loss over the last logged interval
    curve: tuple[TrainLog, ...] = field(default_factory=tuple)
    stopped_by: str = "steps"  # "steps" or "time"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def train_lm(
    model: torch.nn.Module,
    token_stream: npt.NDArray[np.integer] | torch.Tensor,
    config: TrainConfig | None = None,
    log: Callable[[TrainLog], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    *,
    loss_mask: npt.NDArray[np.integer] | npt.NDArray[np.bool_] | torch.Tensor | None = None,
    window_starts: npt.NDArray[np.integer] | torch.Tensor | None = None,
) -> TrainResult:
    """Trains ``model`` in place on random windows of ``token_stream`` (a 1-D array of
    token ids, longer than ``seq_len``); returns the loss curve.

    ``loss_mask`` (optional, 0/1 or bool, aligned with ``token_stream``) selects the
    tokens that are learned: the prediction of token ``i`` counts when
    ``loss_mask[i]`` is 1, and the loss is the mean over the selected targets of a
    batch (``None``: every target counts). ``window_starts`` (optional) lists the
    positions a window may start at, each at most ``len(token_stream) - seq_len - 1``
    (``None``: any position). The model is trained in its current dtype and device
    and left in eval mode.
    """
    cfg = config if config is not None else TrainConfig()
    stream = _as_stream(token_stream, cfg.seq_len)
    vocab = _vocab_size(model)
    if vocab is not None and int(stream.max()) >= vocab:
        raise ValueError(f"token id {int(stream.max())} outside the model's vocabulary ({vocab})")
    mask = None if loss_mask is None else _as_mask(loss_mask, len(stream))
    starts = None if window_starts is None else _as_starts(window_starts,
                                                           len(stream) - cfg.seq_len)
    if mask is not None:
        if starts is None:
            if not bool(mask[1:].any()):
                raise ValueError("loss_mask selects no token to predict")
        else:
            # targets of the window at s: s + 1 .. s + seq_len; counted with a prefix sum
            before = torch.cat([torch.zeros(1, dtype=torch.int64), mask.cumsum(0)])
            if not bool((before[starts + cfg.seq_len + 1] - before[starts + 1] > 0).any()):
                raise ValueError("loss_mask selects no token inside the windows of "
                                 "window_starts")
    old_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        # The caller's global RNGs are left as they were: the CPU's, and those of the
        # CUDA devices the model is on (dropout there draws from theirs).
        cuda = sorted({p.device.index or 0 for p in model.parameters()
                       if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda):
            return _train(model, stream, cfg, log, clock, mask, starts)
    finally:
        model.eval()  # also when training fails (a non-finite loss, a failing ``log``)
        if cfg.threads is not None:
            torch.set_num_threads(old_threads)


def _train(
    model: torch.nn.Module,
    stream: torch.Tensor,
    cfg: TrainConfig,
    log: Callable[[TrainLog], None] | None,
    clock: Callable[[], float],
    mask: torch.Tensor | None = None,
    window_starts: torch.Tensor | None = None,
) -> TrainResult:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    param = next(model.parameters())
    device = param.device
    forward = getattr(model, "forward_dense", None) or model
    autocast_dtype = None if cfg.autocast is None else getattr(torch, cfg.autocast)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False,
    )
    offsets = torch.arange(cfg.seq_len + 1)
    num_starts = len(stream) - cfg.seq_len
    curve: list[TrainLog] = []
    window_losses: list[float] = []
    first_loss = math.nan
    start = clock()
    step = 0
    stopped_by = "steps"
    model.train()
    lr = cfg.lr
    while step < cfg.steps:
        elapsed = clock() - start
        if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
            stopped_by = "time"
            break
        progress = step / cfg.steps
        if cfg.time_budget_s is not None:
            progress = max(progress, elapsed / cfg.time_budget_s)
        lr = cfg.lr_at(progress, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if window_starts is None:
            starts = torch.from_numpy(rng.integers(0, num_starts, size=cfg.batch_size))
        else:
            picks = torch.from_numpy(rng.integers(0, len(window_starts), size=cfg.batch_size))
            starts = window_starts[picks]
        index = starts[:, None] + offsets  # [B, T+1]
        windows = stream[index].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = forward(windows[:, :-1])  # [B, T, V]
        flat_logits = logits.float().reshape(-1, logits.shape[-1])
        if mask is None:
            loss = F.cross_entropy(flat_logits, windows[:, 1:].reshape(-1))
        else:
            weights = mask[index[:, 1:]].to(device=device, dtype=torch.float32).reshape(-1)
            losses = F.cross_entropy(flat_logits, windows[:, 1:].reshape(-1), reduction="none")
            loss = (losses * weights).sum() / weights.sum().clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
        optimizer.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {step}")
        if step == 0:
            first_loss = value
        window_losses.append(value)
        step += 1
        if step % cfg.log_every == 0:
            curve.append(_point(step, window_losses, lr, clock() - start, cfg))
            window_losses = []
            if log is not None:
                log(curve[-1])
    if window_losses:
        curve.append(_point(step, window_losses, lr, clock() - start, cfg))
        if log is not None:
            log(curve[-1])
    model.eval()
    return TrainResult(
        steps=step,
        tokens=step * cfg.tokens_per_step,
        seconds=clock() - start,
        first_loss=first_loss,
        final_loss=curve[-1].loss if curve else math.nan,
        curve=tuple(curve),
        stopped_by=stopped_by,
    )


def _point(step: int, losses: list[float], lr: float, elapsed: float, cfg: TrainConfig) -> TrainLog:
    return TrainLog(step=step, loss=float(np.mean(losses)), lr=lr, elapsed_s=elapsed,
                    tokens=step * cfg.tokens_per_step)


def _as_stream(tokens: npt.NDArray[np.integer] | torch.Tensor, seq_len: int) -> torch.Tensor:
    arr = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token_stream must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_stream must hold integers, got {arr.dtype}")
    if len(arr) < seq_len + 1:
        raise ValueError(f"token_stream has {len(arr)} tokens; seq_len {seq_len} needs more")
    if int(arr.min()) < 0:
        raise ValueError("token_stream holds negative token ids")
    return torch.from_numpy(arr.astype(np.int64))


def _as_mask(mask: npt.NDArray[np.integer] | npt.NDArray[np.bool_] | torch.Tensor,
             length: int) -> torch.Tensor:
    arr = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if arr.shape != (length,):
        raise ValueError(f"loss_mask must be 1-D and as long as token_stream ({length}), "
                         f"got shape {arr.shape}")
    if arr.dtype != np.bool_ and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"loss_mask must hold 0/1 integers or bools, got {arr.dtype}")
    if arr.dtype != np.bool_ and len(arr) and (int(arr.min()) < 0 or int(arr.max()) > 1):
        raise ValueError("loss_mask must hold only 0 and 1")
    return torch.from_numpy(arr.astype(np.bool_))


def _as_starts(starts: npt.NDArray[np.integer] | torch.Tensor, num_starts: int) -> torch.Tensor:
    arr = starts.detach().cpu().numpy() if isinstance(starts, torch.Tensor) else np.asarray(starts)
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError(f"window_starts must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"window_starts must hold integers, got {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= num_starts:
        raise ValueError(f"window_starts must lie in [0, {num_starts - 1}] (a window needs "
                         "seq_len + 1 tokens)")
    return torch.from_numpy(arr.astype(np.int64))


def _vocab_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None
