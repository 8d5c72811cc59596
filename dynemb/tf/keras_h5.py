"""Keras 3 weights: `.weights.h5` (model.save_weights) and `.keras` (model.save: a zip holding
config.json, metadata.json and model.weights.h5), read with h5py.

    layers/<layer key>/vars/<i>     the layer's i-th variable; the group layers/<key>/vars has
                                    an attribute name = the layer's own name (e.g. user_emb)
    optimizer/vars/<i>              the optimizer's variables (its vars group is named after
                                    the optimizer: adam, adagrad...): iteration and learning
                                    rate first, then its slots in the order of the model's
                                    trainable variables (Adam: m then v of each)

The file keeps no variable names for the optimizer's slots, so a table's slots are the
optimizer variables of the table's shape (Adagrad: one; Adam: two, m before v), taken only
when no other model variable has that shape; otherwise `dynemb tf ls` says so and the slots
can be named in the --table spec (accumulator=optimizer/vars/2 ...). A .keras file's zip
CRC-32 is checked as it is read; HDF5 files carry no checksum of their own.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import zipfile
from typing import TYPE_CHECKING

import numpy as np

from dynemb.tf.bundle import TensorInfo
from dynemb.tf.errors import TFMigrationError
from dynemb.tf.source import FLOAT_DTYPES, Rows, Source, Table

if TYPE_CHECKING:
    import h5py

SLOT_KINDS = {"adam": ("m", "v"), "adagrad": ("accumulator",)}
WEIGHTS_MEMBER = "model.weights.h5"


def _h5():
    import h5py  # only Keras files need it

    return h5py


class KerasSource(Source):
    """The tensors of a Keras 3 .keras archive or .weights.h5 file (HDF5 datasets).

    Args:
        path: the file; a .keras archive's weights are unzipped to a temporary file.

    Raises:
        TFMigrationError: the file is missing, or not a readable archive or HDF5 file.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        h5 = _h5()  # (not named h5py: that name is the annotations' module, below)
        self._spool = None
        try:
            if path.lower().endswith(".keras"):
                self.kind = "Keras 3 model archive (.keras)"
                self._spool = self._unzip(path)
                self.file = h5.File(self._spool, "r")
            else:
                self.kind = "Keras 3 weights (.weights.h5)"
                self.file = h5.File(path, "r")
        except FileNotFoundError:
            raise TFMigrationError(f"{path}: no such file") from None
        except OSError as exc:
            raise TFMigrationError(f"{path}: not a readable HDF5 file (truncated or corrupt?): {exc}") from None
        self.datasets: dict[str, h5py.Dataset] = {}  # (h5py has no type information: Any to mypy)
        self.file.visititems(
            lambda name, obj: self.datasets.__setitem__(name, obj) if isinstance(obj, h5.Dataset) else None
        )

    def _unzip(self, path: str):
        try:
            with zipfile.ZipFile(path) as z:
                if WEIGHTS_MEMBER not in z.namelist():
                    raise TFMigrationError(
                        f"{path}: a zip without {WEIGHTS_MEMBER}; not a Keras 3 .keras file (it has {z.namelist()[:5]})"
                    )
                spool = tempfile.TemporaryFile()
                with z.open(WEIGHTS_MEMBER) as member:  # raises BadZipFile on a CRC-32 mismatch
                    shutil.copyfileobj(member, spool, 4 << 20)
                spool.seek(0)
                return spool
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
            raise TFMigrationError(f"{path}: not a readable .keras archive (truncated or corrupt?): {exc}") from None

    def _info(self, name: str) -> TensorInfo:
        ds = self.datasets[name]
        kind = ds.dtype.name if ds.dtype.kind in "fiub" else str(ds.dtype)
        return TensorInfo(name, kind, tuple(int(n) for n in ds.shape))

    def tensors(self) -> list[TensorInfo]:
        """See Source.tensors: every dataset, in natural order of names."""
        return [self._info(n) for n in sorted(self.datasets, key=_natural)]

    def _is_tensor(self, name: str) -> bool:
        return name in self.datasets

    def rows(self, name: str) -> Rows:
        """See Source.rows; its verify() reads every row (HDF5 has no checksums)."""
        name = self.resolve(name)
        if name not in self.datasets:
            raise TFMigrationError(f"{self.path}: no dataset named {name!r} (see `dynemb tf ls`)")
        ds, info = self.datasets[name], self._info(name)

        def read(lo: int, hi: int) -> np.ndarray:
            try:
                return np.asarray(ds[lo:hi])
            except OSError as exc:
                raise TFMigrationError(
                    f"{self.path}: dataset {name!r} cannot be read (truncated or corrupt?): {exc}"
                ) from None

        def verify() -> None:  # no checksums in HDF5: read every row, so a truncated file fails here
            step = max(1, (16 << 20) // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))))
            for lo in range(0, info.shape[0] if info.shape else 0, step):
                read(lo, lo + step)

        return Rows(name, info.dtype, info.shape, read, verify)

    def layer_name(self, name: str) -> str | None:
        """The `name` attribute of the group holding dataset name (its layer's name), or None."""
        group = name.rpartition("/")[0]
        return self.file[group].attrs.get("name") if group in self.file else None

    def _find(self) -> dict[str, Table]:
        infos = {t.name: t for t in self.tensors()}
        model = [i for n, i in infos.items() if n.startswith("layers/") and i.dtype in FLOAT_DTYPES]
        opt_vars = [i for n, i in infos.items() if n.startswith("optimizer/vars/")]
        opt_name = str(self.file["optimizer/vars"].attrs.get("name", "")) if "optimizer/vars" in self.file else ""
        kinds = next((k for key, k in SLOT_KINDS.items() if key in opt_name.lower()), ())
        tables: dict[str, Table] = {}
        for info in model:
            if len(info.shape) != 2:
                continue
            table = Table(info.name, self.rows(info.name), kind=f"Keras layer {self.layer_name(info.name)}")
            same = [m.name for m in model if m.shape == info.shape]
            cands = [v.name for v in opt_vars if v.shape == info.shape]
            if kinds and len(same) == 1 and len(cands) == len(kinds):
                table.slots = {k: self.rows(c) for k, c in zip(kinds, cands)}
            elif kinds and cands:
                table.note = (
                    f"slots not matched: {len(same)} model variables and {len(cands)} {opt_name} "
                    f"variables have shape {list(info.shape)}; name them in --table ("
                    + ", ".join(f"{k}=optimizer/vars/N" for k in kinds)
                    + ")"
                )
            tables[info.name] = table
            self.add_alias(str(self.layer_name(info.name) or ""), info.name)
        for name in tables:  # a layer with one table: listed by the layer's name
            layer = str(self.layer_name(name) or "")
            if self.aliases.get(layer) == name:
                self.show(name, layer)
        return tables


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def open_keras(path: str) -> KerasSource:
    """A Source over a Keras 3 file (model.weights.h5 or model.keras).

    Raises:
        TFMigrationError: the file is no readable HDF5 file or .keras archive.
    """
    return KerasSource(path)
