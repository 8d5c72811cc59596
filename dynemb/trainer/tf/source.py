"""Open any supported TensorFlow file and find its embedding tables and their optimizer slots.

    open_source("ckpt_dir/")            a folder with a `checkpoint` file: its latest checkpoint
    open_source("ckpt_dir/ckpt-3")      a checkpoint prefix (ckpt-3.index beside it)
    open_source("ckpt_dir/ckpt-3.index")   or ckpt-3.data-00000-of-00001: the same prefix
    open_source("saved_model/")         a SavedModel: its variables/variables bundle
    open_source("model.weights.h5")     Keras 3 weights (h5py)
    open_source("model.keras")          Keras 3 model archive (its model.weights.h5)

A Table is what `dynemb tf migrate --table NAME=TENSOR` moves: its values (rows, dim), its
ids where the checkpoint has them (TFRA keys), and its optimizer slots row-aligned with the
values under canonical names: accumulator (Adagrad), m and v (Adam's first and second moments).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dynemb.trainer.tf.bundle import Bundle, TensorInfo
from dynemb.trainer.tf.errors import TFMigrationError

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass
class Rows:
    """A tensor (or several, concatenated) read by ranges of rows."""

    label: str  # the tensor name(s), for messages
    dtype: str  # TensorFlow's dtype name: float32, bfloat16 (as uint16 bits), int64, string...
    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]  # rows [lo, hi)
    verify: Callable[[], None]  # checksums; raises TFMigrationError
    missing: Callable[[int, int], np.ndarray] | None = None  # rows absent (key-aligned slots)
    parts: tuple[str, ...] = ()  # every tensor read (default: the label)

    def __post_init__(self) -> None:
        self.parts = self.parts or (self.label,)

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 0


@dataclass
class Table:
    name: str
    values: Rows
    keys: Rows | None = None  # the ids, where the checkpoint stores them (TFRA)
    slots: dict[str, Rows] = field(default_factory=dict)
    kind: str = "variable"
    note: str = ""  # e.g. why slots were not matched


def bundle_rows(bundle: Bundle, name: str) -> Rows:
    info = bundle.info(name)
    return Rows(name, info.dtype, info.shape, lambda lo, hi: bundle.read_rows(name, lo, hi),
                lambda: bundle.verify(name))


def concat_rows(parts: list[Rows], label: str) -> Rows:
    """Several tensors of equal trailing shape read as one, in order."""
    if len({p.shape[1:] for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
        raise TFMigrationError(f"{label}: its parts differ in dtype or shape: "
                              + ", ".join(f"{p.label} {p.dtype} {list(p.shape)}" for p in parts))
    bounds = np.cumsum([0] + [p.num_rows for p in parts])

    def read(lo: int, hi: int) -> np.ndarray:
        out = [p.read(max(lo, a) - a, min(hi, b) - a)
               for p, a, b in zip(parts, bounds[:-1], bounds[1:]) if max(lo, a) < min(hi, b)]
        return np.concatenate(out) if out else parts[0].read(0, 0)

    def verify() -> None:
        for p in parts:
            p.verify()

    return Rows(label, parts[0].dtype, (int(bounds[-1]), *parts[0].shape[1:]), read, verify,
                parts=tuple(n for p in parts for n in p.parts))


class Source:
    """A checkpoint's tensors and tables. Subclasses fill `kind`, tensors() and _find()."""

    kind = "checkpoint"

    def __init__(self, path: str) -> None:
        self.path = path
        self._tables: dict[str, Table] | None = None
        self.aliases: dict[str, str] = {}  # other names a table answers to

    def tensors(self) -> list[TensorInfo]:
        raise NotImplementedError

    def rows(self, name: str) -> Rows:
        raise NotImplementedError

    def _find(self) -> dict[str, Table]:
        raise NotImplementedError

    def tables(self) -> dict[str, Table]:
        if self._tables is None:
            self._tables = self._find()
        return self._tables

    def table(self, name: str) -> Table:
        """The table a --table spec names: a found table (or an alias of one), else any 2-D
        tensor of that name, without slots."""
        tables = self.tables()
        name = self.aliases.get(name, name)
        if name in tables:
            return tables[name]
        known = {t.name for t in self.tensors()}
        if name not in known:
            hint = ", ".join(sorted(tables)[:8])
            raise TFMigrationError(f"{self.path}: no tensor or table named {name!r}"
                                  + (f"; tables found: {hint}" if hint else "") + " (see `dynemb tf ls`)")
        return Table(name, self.rows(name))


class BundleSource(Source):
    def __init__(self, path: str, bundle: Bundle, kind: str) -> None:
        super().__init__(path)
        self.bundle = bundle
        self.kind = kind

    def tensors(self) -> list[TensorInfo]:
        return [self.bundle.info(n) for n in self.bundle.names()]

    def rows(self, name: str) -> Rows:
        name = self.aliases.get(name, name)
        if name not in self.bundle.entries and name + VALUE_SUFFIX in self.bundle.entries:
            name += VALUE_SUFFIX
        return bundle_rows(self.bundle, name)

    def _find(self) -> dict[str, Table]:
        from dynemb.trainer.tf import objects, saver, tfra

        infos = {t.name: t for t in self.tensors()}
        found = tfra.find(self.bundle, infos)
        if OBJECT_GRAPH_KEY in infos:
            slots = objects.slots(self.bundle.read(OBJECT_GRAPH_KEY)[()], self.path)
        else:
            slots = saver.slots(infos)
        slot_names = {s for per in slots.values() for s in per.values()}
        for name, info in infos.items():
            if (tfra.is_tfra(name) or name in slot_names or info.dtype not in FLOAT_DTYPES or len(info.shape) != 2):
                continue
            per = slots.get(name, {})
            found[name] = Table(name, bundle_rows(self.bundle, name),
                                slots={s: bundle_rows(self.bundle, t) for s, t in per.items()},
                                kind=f"partitioned variable ({info.slices} slices)" if info.slices else "variable")
            if name.endswith(VALUE_SUFFIX):
                self.aliases[name.removesuffix(VALUE_SUFFIX)] = name
        return found


def _latest_in(folder: str) -> str | None:
    """The model_checkpoint_path of a TensorFlow `checkpoint` state file, resolved."""
    state = os.path.join(folder, "checkpoint")
    if not os.path.isfile(state):
        return None
    m = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', open(state, encoding="utf-8").read(), re.M)
    if not m:
        raise TFMigrationError(f"{state}: no model_checkpoint_path line")
    path = m.group(1)
    if not os.path.isabs(path):
        return os.path.join(folder, path)
    # an absolute path from where the checkpoint was written: the folder may have moved since
    return path if os.path.isfile(path + ".index") else os.path.join(folder, os.path.basename(path))


def open_source(path: str) -> Source:
    """Open a checkpoint prefix (or one of its .index / .data-NNNNN-of-NNNNN files), a checkpoint
    folder, a SavedModel, a .weights.h5 or a .keras file.

    Raises:
        TFMigrationError: the path is none of these, or its files cannot be read.
    """
    path = str(path)
    lower = path.lower()
    if lower.endswith((".h5", ".hdf5", ".keras")):
        from dynemb.trainer.tf.keras_h5 import open_keras

        return open_keras(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "saved_model.pb")) or os.path.isfile(
                os.path.join(path, "variables", "variables.index")):
            prefix = os.path.join(path, "variables", "variables")
            return BundleSource(path, Bundle(prefix), "SavedModel variables")
        latest = _latest_in(path)
        if latest is None:
            indexes = sorted(f for f in os.listdir(path) if f.endswith(".index"))
            if len(indexes) != 1:
                raise TFMigrationError(f"{path}: a folder without a `checkpoint` file or saved_model.pb, and "
                                      f"{len(indexes)} .index files in it; give the checkpoint prefix itself")
            latest = os.path.join(path, indexes[0][: -len(".index")])
        path = latest
    # the files of a prefix P are P.index and P.data-00000-of-0000N: any of them names P
    path = re.sub(r"\.(index|data-\d{5}-of-\d{5})$", "", path)
    if not os.path.isfile(path + ".index"):
        raise TFMigrationError(f"{path}: not a checkpoint (no {path}.index), a checkpoint folder, a SavedModel, "
                              f"or a Keras .weights.h5 / .keras file")
    bundle = Bundle(path)
    kind = "TF2 object-based checkpoint" if OBJECT_GRAPH_KEY in bundle.entries else "TF1 Saver checkpoint"
    return BundleSource(path, bundle, kind)
