"""Checkpoints: atomic, resharding, every rank writing its own shards.

``save(path, state)`` writes every rank's own shards with ``torch.distributed.checkpoint``
into a temporary sibling ``<path>.tmp-<id>``; after every rank has finished, rank 0 writes a
marker (:data:`MARKER`: keys, shapes, file sizes and CRC32s) and renames the directory to
``path``. An existing checkpoint at ``path`` is renamed to ``<path>.old-<id>`` first and
removed after; :func:`load` and :func:`latest` resolve the leftovers of a crash between the
two renames, and the next save cleans them up. ``load(path, like)`` checks the marker and
the files before reading anything and reshards to ``like``'s mesh.

    >>> save("ckpt/step_000100", state)                # every rank; returns the path
    >>> state = load(latest("ckpt"), like=state)       # any world size or mesh
    >>> state = load("ckpt", like=state)               # the same: a directory's newest
    >>> export_full("model.pt", state.params)          # one torch.save file of full tensors
    >>> export_module(model, state.params)             # into an nn.Module (rank 0)

Where each part lives: ``saving`` (save, async saving), ``loading`` (load), ``checks``
(arguments checked and compared across ranks), ``lock`` (one save at a time per path),
``atomic`` (the temporary sibling, the marker, the commit, crash recovery, CRC32s), ``dirs``
(latest, prune), ``export`` (export_full, import_full, export_module), ``trust`` (DCP's
pickles read through allowlists: a checkpoint from elsewhere cannot run code), ``errors``
(CheckpointError). Every rank must call save and load: one made on some ranks only fails by
name on every rank (:mod:`funshard.collectives.calls`). The state dicts (``state_dict`` /
``load_state_dict``) live in :mod:`funshard.state_dict` and are re-exported here.
"""

from ..state_dict import KINDS, LocalShard, load_state_dict, state_dict
from .atomic import FORMAT, MARKER
from .dirs import latest, prune
from .errors import CheckpointError
from .export import export_full, export_module, import_full
from .loading import load
from .saving import save

__all__ = [
    "FORMAT",
    "KINDS",
    "MARKER",
    "CheckpointError",
    "LocalShard",
    "export_full",
    "export_module",
    "import_full",
    "latest",
    "load",
    "load_state_dict",
    "prune",
    "save",
    "state_dict",
]
