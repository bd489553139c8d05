"""Optimizers over sharded parameter trees, optax-style: small ``GradientTransformation(init,
update)`` pieces composed by ``chain`` into an ``Optimizer`` that ``fs.train_step`` runs on the
local shards. State is DTensors sharded like the params (``fs.state_dict``, ``fs.checkpoint``).

    >>> opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0),
    ...                      fs.optim.adamw(fs.optim.warmup_cosine(3e-4, 100, 10_000)))

Modules: ``base`` (the types, [Note: pending updates]), ``apply`` (transformation ->
optimizer), ``transforms`` (elementwise pieces), ``clip`` (global norm, finite check),
``measured`` (what the step measured, for clip), ``with_policy`` (the Policy's clip and skip
in front), ``combine`` (chain, masked, multi_transform), ``schedules``, ``alias`` (sgd, adam,
adamw).
"""

from .alias import adam, adamw, sgd
from .apply import as_optimizer
from .base import Delta, EmptyState, GradientTransformation, Optimizer, materialize
from .clip import all_finite, apply_if_finite, clip_by_global_norm, global_norm
from .combine import MultiTransformState, chain, masked, multi_transform, set_to_zero
from .muon import MuonState, muon, newton_schulz, owners, scale_by_muon
from .torch_optim import ELEMENTWISE, TorchState, from_torch
from .schedules import constant, cosine, join, linear, warmup_cosine
from .transforms import (AdamState, AdamWState, SGDState, TraceState, add_decayed_weights, scale,
                         scale_by_adam, scale_by_learning_rate, trace)

__all__ = [
    "AdamState", "AdamWState", "Delta", "EmptyState", "GradientTransformation",
    "MultiTransformState", "Optimizer", "SGDState", "TraceState", "adam", "adamw",
    "add_decayed_weights", "all_finite", "apply_if_finite", "as_optimizer", "chain",
    "ELEMENTWISE", "TorchState", "from_torch", "MuonState", "muon", "newton_schulz",
    "owners", "scale_by_muon",
    "clip_by_global_norm", "constant", "cosine", "global_norm", "join", "linear", "masked",
    "materialize", "multi_transform", "scale", "scale_by_adam", "scale_by_learning_rate",
    "set_to_zero", "sgd", "trace", "warmup_cosine",
]
