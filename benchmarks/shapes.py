"""The benchmark's model shapes: the fixed three (A, B, C), and the default GPT.

    gpt   GPT (:class:`funshard.testing.models.GPT`), ``--blocks`` x ``--dim``, tokens
    A     8 x ``nn.TransformerEncoderLayer(512)`` (8 heads, feed-forward 2048), batch 4 x 64
    B     4 MLP blocks d=1024, hidden 8192 (residual, GELU), batch 2 x 8: big leaves, tiny
          activations (the optimizer's and the gradients' transients dominate)
    C     GPT 4 blocks d=256, batch 8 x 512: activations dominate

Every shape is a module whose blocks are ``model.layers`` (funshard's default groups, one
``fully_shard`` each for FSDP2), a ``loss(model)`` of ``(params, batch)``, and batches.

    >>> cfg = dataclasses.replace(Config(), **SHAPES["B"])
    >>> model = model_of(cfg); loss_fn = loss_of(cfg, model)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from funshard.testing.models import GPT, gpt_loss, mse_loss

# Config fields per shape (``--shape``); "gpt" keeps the command line's own
SHAPES = {
    "gpt": {},
    "A": dict(kind="encoder", blocks=8, dim=512, batch=4, seq=64),
    "B": dict(kind="mlp", blocks=4, dim=1024, hidden=8192, batch=2, seq=8),
    "C": dict(kind="gpt", blocks=4, dim=256, batch=8, seq=512),
}
LABELS = {"A": "A: 8 x TransformerEncoderLayer(512), batch 4x64",
          "B": "B: 4 MLP blocks d=1024 hidden 8192, batch 2x8",
          "C": "C: 4 blocks d=256, batch 8x512"}


class MLPBlock(nn.Module):
    """``x + W2 gelu(W1 x)``: (B, T, d) -> (B, T, d)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(x)))


class Stack(nn.Module):
    """Blocks in ``layers`` applied in turn; nothing else holds parameters."""

    def __init__(self, blocks):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def model_of(cfg) -> nn.Module:
    """The shape's module (built on the current default device)."""
    if cfg.kind == "gpt":
        return GPT(vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads, layers=cfg.blocks, seq=cfg.seq)
    if cfg.kind == "encoder":
        return Stack(nn.TransformerEncoderLayer(cfg.dim, nhead=cfg.heads, batch_first=True)
                     for _ in range(cfg.blocks))
    if cfg.kind == "mlp":
        return Stack(MLPBlock(cfg.dim, cfg.hidden) for _ in range(cfg.blocks))
    raise ValueError(f"bench: unknown model kind {cfg.kind!r}; choose gpt, encoder or mlp")


def loss_of(cfg, model: nn.Module):
    """``loss_fn(params, batch)`` through ``model``: cross-entropy (gpt) or mean squared error."""
    return gpt_loss(model) if cfg.kind == "gpt" else mse_loss(model)


def plain_loss(cfg, model: nn.Module, batch) -> torch.Tensor:
    """The same loss for a module called directly (FSDP2, DDP, the floor)."""
    x, y = batch
    if cfg.kind == "gpt":
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    return F.mse_loss(model(x).float(), y)


def batches(cfg, rank: int, device, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` per-rank batches, (batch, seq) tokens or (batch, seq, dim) floats; the same in
    every mode."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    if cfg.kind == "gpt":
        make = lambda: torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)  # noqa
    else:
        make = lambda: torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g)  # noqa
    return [tuple(make().to(device) for _ in range(2)) for _ in range(n)]
