"""What a prepared row is, as one short hash (kept apart from store.py, which is part of the tiny targets' build key)."""

from __future__ import annotations

import hashlib

import numpy as np


def row_hash(input_ids, loss_mask) -> str:
    """sha256 (16 hex) of a prepared row's token ids and loss mask (int64 little-endian). Prepare keeps it for every
    row as it judged it, the extract manifest for every row it extracted; verify compares both with the row as the
    trainer will read it, so a shifted mask or reordered rows fail (the mask is in no record)."""
    h = hashlib.sha256(np.asarray(input_ids, dtype="<i8").tobytes())
    h.update(b"|")
    h.update(np.asarray(loss_mask, dtype="<i8").tobytes())
    return h.hexdigest()[:16]
