"""How bytes move: bucketed all-gathers and gradient reductions over a funshard mesh, on an
explicitly chosen transport (see :mod:`funshard.collectives.base`)."""

from . import failures
from .base import (TRANSPORTS, CollectiveTimeout, Gathered, Transport, announce,
                   force_collectives, skips, watch)
from .gather import all_gather, all_to_all, check_transport, choose
from .failures import CollectiveRefused, OutOfStep, PeerLost, RankFailed
from .p2p import is_direct_message
from .reduce import GradBucket, Reducing, reduce_scatter

__all__ = [
    "TRANSPORTS",
    "CollectiveRefused",
    "CollectiveTimeout",
    "Gathered",
    "OutOfStep",
    "PeerLost",
    "RankFailed",
    "GradBucket",
    "Reducing",
    "Transport",
    "all_gather",
    "all_to_all",
    "announce",
    "check_transport",
    "failures",
    "force_collectives",
    "choose",
    "is_direct_message",
    "reduce_scatter",
    "skips",
    "watch",
]
