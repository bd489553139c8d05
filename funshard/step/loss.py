"""What ``loss_fn`` returns: a floating scalar loss (the mean over the local batch), or
``(loss, aux)``; the loss must reach a trainable parameter."""

from __future__ import annotations

from typing import Any

import torch


def loss_of(out: Any) -> tuple[torch.Tensor, Any]:
    loss, aux = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
        raise ValueError(
            f"train_step: loss_fn must return a floating scalar tensor (or (loss, aux)), got "
            f"{what}; reduce it, e.g. with .mean()."
        )
    return loss, aux


def check_differentiable(loss: torch.Tensor) -> None:
    if not loss.requires_grad:
        raise ValueError(
            "train_step: the loss does not require grad, so the step would change nothing: "
            "loss_fn returned a detached loss (loss.detach(), .item(), a new tensor) or one "
            "that no trainable parameter reaches. Return the loss as computed from params."
        )
