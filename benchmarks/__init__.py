"""Benchmarks, outside the library: run from the repository root.

    python -m benchmarks.bench --help          # funshard vs FSDP2, DDP and the floor
    python -m benchmarks.checkpoint_io         # checkpoint throughput and memory

Dated results live in ``benchmarks/results/``.
"""
