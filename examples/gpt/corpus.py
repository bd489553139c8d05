"""The demo's data: a text file as bytes, and deterministic random windows of it.

    >>> data = load_corpus(None)                          # the KJV shipped in data/kjv.txt
    >>> x, y = get_batch(data, step=0, dp_rank=1, batch=4, seq=64, seed=0)   # (4, 64) each
"""

from __future__ import annotations

from pathlib import Path

import torch

KJV = Path(__file__).resolve().parent / "data" / "kjv.txt"


def load_corpus(path: str | None) -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes."""
    data = (KJV if path is None else Path(path)).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(data: torch.Tensor, step: int, dp_rank: int, batch: int, seq: int, seed: int):
    """Random windows keyed by (seed, step, data-parallel rank): resumable and deterministic."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + dp_rank)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()  # (B, T+1)
    return rows[:, :-1], rows[:, 1:]
