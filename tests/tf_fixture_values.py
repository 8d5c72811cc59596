"""The known values in tests/fixtures/tf/: scripts/make_tf_fixtures.py writes them with real
TensorFlow, tests/tf/test_tf_migrate.py recomputes them here and compares exactly. numpy only.

Every value is a small multiple of a power of two, so float32 (and, for `small`, bfloat16)
holds it exactly and no rounding differs between TensorFlow and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def values(seed: int, rows: int, dim: int) -> np.ndarray:
    """Signed values k/256, |k| <= 1001: embeddings and Adam's m."""
    i, j = np.arange(rows)[:, None], np.arange(dim)[None, :]
    k = (i * 7919 + j * 104729 + seed * 15485863) % 2003
    return ((k - 1001) / 256).astype(np.float32)


def positive(seed: int, rows: int, dim: int) -> np.ndarray:
    """Positive values 1/8 + k/512: Adagrad accumulators and Adam's v."""
    i, j = np.arange(rows)[:, None], np.arange(dim)[None, :]
    k = (i * 6151 + j * 3079 + seed * 49157) % 1999
    return (0.125 + k / 512).astype(np.float32)


def small(seed: int, rows: int, dim: int) -> np.ndarray:
    """Signed values with at most 7 significant bits: exact in bfloat16."""
    i, j = np.arange(rows)[:, None], np.arange(dim)[None, :]
    return ((((i * 31 + j * 17 + seed) % 255) - 127) / 16).astype(np.float32)


KINDS = {"values": values, "positive": positive, "small": small}


@dataclass(frozen=True)
class Known:
    """A table in a fixture: its values and its optimizer slots, each (kind, seed)."""

    rows: int
    dim: int
    seed: int
    kind: str = "values"
    slots: dict[str, tuple[str, int]] = field(default_factory=dict)  # accumulator / m / v
    keys: tuple = ()  # TFRA: the ids (or string keys) of rows 0, 1, ...
    slot_missing: tuple = ()  # TFRA: keys the slot tables do not hold

    def array(self) -> np.ndarray:
        return KINDS[self.kind](self.seed, self.rows, self.dim)

    def slot(self, name: str) -> np.ndarray:
        kind, seed = self.slots[name]
        return KINDS[kind](seed, self.rows, self.dim)


TFRA_KEYS = (3, 17, -5, 1 << 40, 99, 1000003, 8)
TFRA_STRING_KEYS = (b"apple", b"kiwi", b"plum", "\u00e9clair".encode(), b"fig")

FIXTURES: dict[str, dict[str, Known]] = {
    # TF1 graph mode, tf.compat.v1.train.Saver; emb/user partitioned in 3 slices (as is its slot)
    "tf1_saver": {
        "emb/user": Known(10, 4, 1, slots={"accumulator": ("positive", 2)}),
        "emb/item": Known(6, 8, 3, slots={"m": ("values", 4), "v": ("positive", 5)}),
        "emb/tag": Known(5, 4, 6, kind="small"),  # bfloat16
    },
    # TF2 tf.train.Checkpoint, tf.compat.v1 Adam: slot_variables in the object graph
    "tf2_slot_variables": {
        "model/user": Known(12, 4, 11, slots={"m": ("values", 12), "v": ("positive", 13)}),
        "model/item": Known(7, 6, 14, slots={"m": ("values", 15), "v": ("positive", 16)}),
    },
    # TF2 tf.train.Checkpoint, Keras 3 Adagrad: parallel lists in the object graph
    "tf2_keras3": {
        "model/user": Known(9, 5, 21, slots={"accumulator": ("positive", 22)}),
    },
    # tf.saved_model.save of a module holding the tables and a Keras 3 Adam
    "saved_model": {
        "model/user": Known(8, 4, 31, slots={"m": ("values", 32), "v": ("positive", 33)}),
    },
    # TFRA (graph mode, Saver): user_de in 2 hash tables with Adam, item_de in 1 with Adagrad
    "tfra_tf1": {
        "user_de": Known(
            len(TFRA_KEYS), 4, 41, slots={"m": ("values", 42), "v": ("positive", 43)}, keys=TFRA_KEYS, slot_missing=(8,)
        ),
        "item_de": Known(
            len(TFRA_KEYS), 3, 44, slots={"accumulator": ("positive", 45)}, keys=TFRA_KEYS, slot_missing=(8,)
        ),
    },
    # TFRA (TF2 eager, tf.train.Checkpoint): string keys in 2 hash tables, no optimizer
    "tfra_tf2": {
        "words": Known(len(TFRA_STRING_KEYS), 4, 51, keys=TFRA_STRING_KEYS),
    },
    # Keras 3 model.save_weights (Adam) and model.save (.keras, Adagrad)
    "keras_weights": {
        "user_emb": Known(11, 4, 61, slots={"m": ("values", 62), "v": ("positive", 63)}),
        "item_emb": Known(5, 6, 64, slots={"m": ("values", 65), "v": ("positive", 66)}),
    },
    "keras_model": {
        "user_emb": Known(11, 4, 71, slots={"accumulator": ("positive", 72)}),
        "item_emb": Known(5, 6, 73, slots={"accumulator": ("positive", 74)}),
    },
    # a Keras 3 model (Adam) saved with tf.train.Checkpoint(model=..., optimizer=...): keys are
    # optimizer/_trainable_variables/N, the layer paths are in the object graph; two embeddings
    # of one shape, and the Dense kernel (a 2-D float variable that is no embedding)
    "keras_checkpoint": {
        "user_emb/embeddings": Known(10, 4, 81, slots={"m": ("values", 82), "v": ("positive", 83)}),
        "item_emb/embeddings": Known(10, 4, 84, slots={"m": ("values", 85), "v": ("positive", 86)}),
        "head/kernel": Known(8, 1, 87, slots={"m": ("values", 88), "v": ("positive", 89)}),
    },
}
