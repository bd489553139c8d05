"""Small reference models for tests, the demo and the benchmark (plain nn.Modules).

    >>> model = GPT(vocab=64, dim=32, heads=4, layers=2, seq=16)
    >>> loss = gpt_loss(model)(fs.params(model), (tokens, targets))   # tokens: (B, T)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..step.call import call


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` blocks, final norm, head tied to the embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2,
                 seq: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for m in self.modules():  # GPT-2 style: small weights, so the first loss is ~ln(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.layers:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


class MLP(nn.Module):
    """A stack of ``layers`` Linear+GELU blocks and a linear head (uneven widths allowed)."""

    def __init__(self, dim: int = 16, hidden: int = 24, layers: int = 4, out: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def gpt_loss(model: nn.Module):
    """``loss_fn(params, (idx, targets))``: next-token cross-entropy through ``model``."""

    def loss_fn(params, batch):
        idx, targets = batch
        logits = call(model, params, idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return loss_fn


def mse_loss(model: nn.Module):
    """``loss_fn(params, (x, y))``: mean squared error through ``model``."""

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(call(model, params, x).float(), y)

    return loss_fn


class MatMulT(torch.autograd.Function):
    """``a @ w.t()`` with a hand-written backward that saves ``w`` (save_for_backward)."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return a @ w.t()

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        return g @ w, g.t() @ a
