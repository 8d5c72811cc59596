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

from dynemb.tf.bundle import Bundle, TensorInfo
from dynemb.tf.errors import TFMigrationError

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
# a name that says embedding: embedding(s), Keras' Embedding layer (and its h5 key), emb, embs
EMBEDDING_NAME = re.compile(r"embed|(^|[^a-z])embs?([^a-z]|$)", re.I)
# an object-path step that is a position in a list: Keras 3 lists, Keras 2 layer-N
POSITIONAL = re.compile(r"(^|/)(\d+|layer(_with_weights)?-\d+)(/|$)")


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
        """Rows along the first dimension (0 for a scalar)."""
        return self.shape[0] if self.shape else 0


@dataclass
class Table:
    """A 2-D float tensor (or TFRA table) that --table can move, with its optimizer slots."""

    name: str
    values: Rows
    keys: Rows | None = None  # the ids, where the checkpoint stores them (TFRA)
    slots: dict[str, Rows] = field(default_factory=dict)
    kind: str = "variable"
    note: str = ""  # e.g. why slots were not matched
    # Likely an embedding: a TFRA table, a partitioned variable, or a name that says so (a
    # Keras Embedding layer's variable is `embeddings`). Others (a Dense kernel) are listed
    # apart by `dynemb tf ls`, and still move when named.
    embedding: bool = False


def bundle_rows(bundle: Bundle, name: str) -> Rows:
    """The Rows of tensor `name` of a bundle, read and verified through it."""
    info = bundle.info(name)
    return Rows(
        name, info.dtype, info.shape, lambda lo, hi: bundle.read_rows(name, lo, hi), lambda: bundle.verify(name)
    )


def concat_rows(parts: list[Rows], label: str) -> Rows:
    """Several tensors of equal trailing shape read as one, in order."""
    if len({p.shape[1:] for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
        raise TFMigrationError(
            f"{label}: its parts differ in dtype or shape: "
            + ", ".join(f"{p.label} {p.dtype} {list(p.shape)}" for p in parts)
        )
    bounds = np.cumsum([0] + [p.num_rows for p in parts])

    def read(lo: int, hi: int) -> np.ndarray:
        out = [
            p.read(max(lo, a) - a, min(hi, b) - a)
            for p, a, b in zip(parts, bounds[:-1], bounds[1:])
            if max(lo, a) < min(hi, b)
        ]
        return np.concatenate(out) if out else parts[0].read(0, 0)

    def verify() -> None:
        for p in parts:
            p.verify()

    return Rows(
        label,
        parts[0].dtype,
        (int(bounds[-1]), *parts[0].shape[1:]),
        read,
        verify,
        parts=tuple(n for p in parts for n in p.parts),
    )


class Source:
    """A checkpoint's tensors and tables. Subclasses fill `kind`, tensors() and _find().

    A tensor answers to its own name and to aliases (a TF2 key without /.ATTRIBUTES/...,
    a variable's name or other object paths, a layer's name), which _find() registers with
    add_alias() and shows with show().
    """

    kind = "checkpoint"

    def __init__(self, path: str) -> None:
        self.path = path
        self._tables: dict[str, Table] | None = None
        self.aliases: dict[str, str] = {}  # other names a tensor answers to → its name
        self.ambiguous: dict[str, set[str]] = {}  # names several tensors would answer to → those
        self.variable_names: dict[str, str] = {}  # tensor → the variable name its object graph gives
        self._shown: dict[str, str] = {}  # tensor → the name `dynemb tf ls` lists it by
        self._aliases_of: dict[str, list[str]] | None = None  # tensor → its aliases (built on demand)

    def add_alias(self, alias: str, name: str) -> None:
        """Let `alias` name tensor `name`; an alias claimed by two tensors names neither."""
        if alias == name or not alias or self._is_tensor(alias):  # a tensor's own name stays its own
            return
        self._aliases_of = None
        if alias in self.ambiguous or self.aliases.get(alias, name) != name:
            self.ambiguous.setdefault(alias, set()).update({name, self.aliases.pop(alias, name)})
            return
        self.aliases[alias] = name

    def show(self, name: str, shown: str) -> None:
        """List tensor `name` as `shown` (an alias of it)."""
        self._shown[name] = shown

    def shown(self, name: str) -> str:
        """The name `dynemb tf ls` lists a tensor or table by."""
        return self._shown.get(name, name)

    def names_of(self, name: str) -> list[str]:
        """A tensor's aliases (an index kept apart: a checkpoint may hold many thousand tensors)."""
        if self._aliases_of is None:
            self._aliases_of = {}
            for a, n in self.aliases.items():
                self._aliases_of.setdefault(n, []).append(a)
        return self._aliases_of.get(name, [])

    def other_names(self, name: str) -> list[str]:
        """The aliases of a tensor other than its shown name, shortest first."""
        return sorted((a for a in self.names_of(name) if a != self.shown(name)), key=lambda a: (a.count("/"), a))

    def resolve(self, name: str) -> str:
        """The tensor an alias (or its own name) names.

        Raises:
            TFMigrationError: the name is an alias of several tensors.
        """
        self.tables()  # registers the aliases
        if name in self.ambiguous:
            raise TFMigrationError(
                f"{self.path}: {name!r} could name any of "
                + ", ".join(sorted(self.shown(n) for n in self.ambiguous[name]))
                + "; give one of those names (see `dynemb tf ls`)"
            )
        return self.aliases.get(name, name)

    def tensors(self) -> list[TensorInfo]:
        """Every tensor of the checkpoint (what `dynemb tf ls` lists)."""
        raise NotImplementedError

    def _is_tensor(self, name: str) -> bool:
        raise NotImplementedError

    def rows(self, name: str) -> Rows:
        """The Rows of a tensor named by its name or an alias.

        Raises:
            TFMigrationError: no such tensor, or an ambiguous alias.
        """
        raise NotImplementedError

    def _find(self) -> dict[str, Table]:
        raise NotImplementedError

    def tables(self) -> dict[str, Table]:
        """{tensor name: Table} of every 2-D float variable and TFRA table, found once."""
        if self._tables is None:
            self._tables = {}  # while _find() runs: it reads rows by their own names
            try:
                self._tables = self._find()
            except BaseException:
                self._tables = None
                raise
            for name, t in self._tables.items():
                names = (name, self.variable_names.get(name, ""), *self.names_of(name))
                t.embedding = t.embedding or any(EMBEDDING_NAME.search(n) for n in names)
        return self._tables

    def table(self, name: str) -> Table:
        """The table a --table spec names: a found table (or an alias of one), else any 2-D
        tensor of that name, without slots."""
        tables = self.tables()
        name = self.resolve(name)
        if name in tables:
            return tables[name]
        known = {t.name for t in self.tensors()}
        if name not in known:
            hint = ", ".join(sorted(self.shown(n) for n in tables)[:8])
            raise TFMigrationError(
                f"{self.path}: no tensor or table named {name!r}"
                + (f"; tables found: {hint}" if hint else "")
                + " (see `dynemb tf ls`)"
            )
        return Table(name, self.rows(name))


class BundleSource(Source):
    """The tensors of a TensorFlow checkpoint bundle (a TF1/TF2 checkpoint or SavedModel variables).

    Args:
        path: the checkpoint's path, for messages.
        bundle: the bundle read.
        kind: what the checkpoint is, for messages.
    """

    def __init__(self, path: str, bundle: Bundle, kind: str) -> None:
        super().__init__(path)
        self.bundle = bundle
        self.kind = kind

    def tensors(self) -> list[TensorInfo]:
        """See Source.tensors."""
        return [self.bundle.info(n) for n in self.bundle.names()]

    def _is_tensor(self, name: str) -> bool:
        return name in self.bundle.entries

    def rows(self, name: str) -> Rows:
        """See Source.rows; a TF2 key may leave out its /.ATTRIBUTES/VARIABLE_VALUE."""
        name = self.resolve(name)
        if name not in self.bundle.entries and name + VALUE_SUFFIX in self.bundle.entries:
            name += VALUE_SUFFIX
        return bundle_rows(self.bundle, name)

    def _find(self) -> dict[str, Table]:
        from dynemb.tf import objects, saver, tfra

        infos = {t.name: t for t in self.tensors()}
        found = tfra.find(self.bundle, infos)
        names: dict[str, objects.VariableNames] = {}
        if OBJECT_GRAPH_KEY in infos:
            graph_bytes = self.bundle.read(OBJECT_GRAPH_KEY)[()]  # a string scalar: bytes
            if not isinstance(graph_bytes, bytes):
                info = infos[OBJECT_GRAPH_KEY]
                raise TFMigrationError(
                    f"{self.path}: the object graph ({OBJECT_GRAPH_KEY}) is not a string "
                    f"scalar but {info.dtype} {list(info.shape)}"
                )
            graph = objects.parse(graph_bytes, self.path)
            slots, names = objects.slots(graph), objects.variables(graph)
        else:
            slots = saver.slots(infos)
        slot_names = {s for per in slots.values() for s in per.values()}
        for name, info in infos.items():
            if tfra.is_tfra(name) or name in slot_names or info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
                continue
            per = slots.get(name, {})
            found[name] = Table(
                name,
                bundle_rows(self.bundle, name),
                slots={s: bundle_rows(self.bundle, t) for s, t in per.items()},
                kind=f"partitioned variable ({info.slices} slices)" if info.slices else "variable",
                embedding=bool(info.slices),
            )  # only embeddings are worth partitioning
        self._name_variables(infos, names, found)
        return found

    def _name_variables(self, infos: dict[str, TensorInfo], names: dict, tables: dict[str, Table]) -> None:
        """Aliases from the key, the object graph and the layer; each tensor shown by the most
        telling name that is its alone."""
        for key in infos:
            self.add_alias(key.removesuffix(VALUE_SUFFIX), key)
            var = names.get(key)
            if var is not None:
                self.variable_names[key] = var.name
                for alias in (var.name, *var.paths):
                    self.add_alias(alias, key)
        for key in tables:  # the layer (user_emb for user_emb/embeddings), where one table is its
            layer = names[key].name.rpartition("/")[0] if key in names else ""
            self.add_alias(layer, key)
        for key in infos:
            short = key.removesuffix(VALUE_SUFFIX)
            self.show(key, short if self.aliases.get(short) == key else key)
            # A key through a list (optimizer/_trainable_variables/0, model/_operations/2/...)
            # tells only positions: the variable's own name (user_emb/embeddings) tells more.
            # Other keys name attributes (model/user), which tf.Variable's default name
            # ("Variable") does not beat.
            own = self.variable_names.get(key, "")
            if POSITIONAL.search(short) and self.aliases.get(own) == key:
                self.show(key, own)


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
        from dynemb.tf.keras_h5 import open_keras

        return open_keras(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "saved_model.pb")) or os.path.isfile(
            os.path.join(path, "variables", "variables.index")
        ):
            prefix = os.path.join(path, "variables", "variables")
            return BundleSource(path, Bundle(prefix), "SavedModel variables")
        latest = _latest_in(path)
        if latest is None:
            indexes = sorted(f for f in os.listdir(path) if f.endswith(".index"))
            if len(indexes) != 1:
                raise TFMigrationError(
                    f"{path}: a folder without a `checkpoint` file or saved_model.pb, and "
                    f"{len(indexes)} .index files in it; give the checkpoint prefix itself"
                )
            latest = os.path.join(path, indexes[0][: -len(".index")])
        path = latest
    # the files of a prefix P are P.index and P.data-00000-of-0000N: any of them names P
    path = re.sub(r"\.(index|data-\d{5}-of-\d{5})$", "", path)
    if not os.path.isfile(path + ".index"):
        raise TFMigrationError(
            f"{path}: not a checkpoint (no {path}.index), a checkpoint folder, a SavedModel, "
            f"or a Keras .weights.h5 / .keras file"
        )
    bundle = Bundle(path)
    kind = "TF2 object-based checkpoint" if OBJECT_GRAPH_KEY in bundle.entries else "TF1 Saver checkpoint"
    return BundleSource(path, bundle, kind)
