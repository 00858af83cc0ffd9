"""The DeepSpeed config a trainer hands the engine: "auto" values filled from the trainer's own settings."""

from __future__ import annotations

import os
from typing import Any, Mapping

from torch import nn

from offload.config import resolve_auto
from offload.config.parse import read_config

__all__ = ["hidden_size", "trainer_config"]


def hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size as Hugging Face's Trainer reads it for the bucket sizes (``config.hidden_size``,
    else the largest of ``config.hidden_sizes``); None when the model has no such config."""
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if size is None and getattr(config, "hidden_sizes", None):
        size = max(config.hidden_sizes)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def trainer_config(config: Mapping[str, Any] | str | os.PathLike, *, model: nn.Module, micro_batch_size: int,
                   gradient_accumulation_steps: int, max_grad_norm: float | None, lr: float | None = None,
                   betas: tuple[float, float] | None = None, eps: float | None = None,
                   weight_decay: float | None = None, warmup_steps: int | None = None,
                   total_steps: int | None = None, fp16: bool | None = None, bf16: bool | None = None
                   ) -> dict[str, Any]:
    """A copy of ``config`` (dict or JSON path) ready for `offload.initialize`: "auto" values filled as
    Hugging Face's ``HfTrainerDeepSpeedConfig`` fills them from the trainer's arguments (`resolve_auto`).

    One difference, on purpose: a config without ``gradient_clipping`` gets the trainer's
    ``max_grad_norm`` (DeepSpeed's default 0 would silently turn off the clipping the trainer asked for).
    Raises ValueError naming the key for an "auto" value nothing fills or a value the arguments contradict.
    """
    raw = read_config(config)
    if "gradient_clipping" not in raw and max_grad_norm is not None:
        raw["gradient_clipping"] = max_grad_norm
    return resolve_auto(raw, micro_batch_size=micro_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
                        hidden_size=hidden_size(model), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        warmup_steps=warmup_steps, total_steps=total_steps, max_grad_norm=max_grad_norm,
                        fp16=fp16, bf16=bf16)
