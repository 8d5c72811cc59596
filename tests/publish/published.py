"""What the publish tests compare: a chain of versions replayed, and rows bit for bit."""

from __future__ import annotations

import numpy as np

from dynemb.publish import chain, dequantize


def replay(root, table: str) -> dict[int, np.ndarray]:
    """What a serving store holds after applying the table's chain: id -> float32 row."""
    held: dict[int, np.ndarray] = {}
    for v in chain(root, table):
        if v.kind == "full":
            held.clear()
        for ids, q in v.row_chunks():
            held.update(zip(ids.tolist(), dequantize(q, v.dtype)))
        for i in v.deleted_ids().tolist():
            held.pop(i, None)
    return held


def same(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> bool:
    """The same ids, each with the same row bit for bit."""
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a)
