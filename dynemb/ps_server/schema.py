"""Table schemas: name, row width and dtype, and the checks every request goes through."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from dynemb.common import names
from dynemb.common.errors import shown
from dynemb.protos import ps_pb2
from dynemb.ps_server.errors import InvalidArgument

# bf16 has no numpy dtype; it travels and is stored as its raw 16 bits (uint16),
# and is widened to float32 only where values are computed (initialisation).
DTYPES: dict[str, np.dtype] = {
    "fp32": np.dtype("<f4"),
    "fp16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
}
_PROTO_DTYPE = {"fp32": ps_pb2.FP32, "fp16": ps_pb2.FP16, "bf16": ps_pb2.BF16}
_DTYPE_FROM_PROTO = {v: k for k, v in _PROTO_DTYPE.items()}

INITIALIZERS = ("zeros", "constant", "uniform", "normal")
_PROTO_INIT = {
    "zeros": ps_pb2.Initializer.ZEROS,
    "constant": ps_pb2.Initializer.CONSTANT,
    "uniform": ps_pb2.Initializer.UNIFORM,
    "normal": ps_pb2.Initializer.NORMAL,
}
_INIT_FROM_PROTO = {v: k for k, v in _PROTO_INIT.items()}
_INIT_FROM_PROTO[ps_pb2.Initializer.KIND_UNSPECIFIED] = "zeros"

MAX_ROW_WIDTH = 1 << 16
# The optimizers whose state a PS row carries after the embedding, and how many floats of it:
# a row is dim + optimizer_state_width(optimizer, dim) floats wide.
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def optimizer_state_width(optimizer: str, dim: int) -> int:
    """Floats of optimizer state per row, stored after the embedding in a PS row."""
    widths = {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}
    if optimizer not in widths:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    return widths[optimizer]


# The most rows a table may declare it expects (TableSchema.expected_rows): far above any one
# store's reach (2^48 rows of 8 bytes are 2 PiB), low enough that a typo's 2^63 is caught.
MAX_EXPECTED_ROWS = 1 << 48


def check_name(name: str, what: str = "table name") -> str:
    """`name` if it is a valid table (or other) name (dynemb/common/names.py: 1 to 128 of
    A-Z a-z 0-9 _ . -, the first not . or -).

    Args:
        name: the name to check.
        what: what it names, for the message.

    Raises:
        InvalidArgument: it is not valid (echoed capped).
    """
    return names.check_name(name, what, InvalidArgument)


@dataclass(frozen=True)
class Initializer:
    """How never-pushed rows are filled on pull (see dynemb/protos/ps.proto)."""

    kind: str = "zeros"
    a: float = 0.0
    b: float = 0.0
    seed: int = 0
    state_init: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in INITIALIZERS:
            raise InvalidArgument(f"initializer kind {shown(self.kind)} is not one of {INITIALIZERS}")
        # NaN would also make a schema unequal to itself: a table could never be re-created
        bad = {k: v for k, v in (("a", self.a), ("b", self.b), ("state_init", self.state_init)) if not math.isfinite(v)}
        if bad:
            raise InvalidArgument(f"initializer values must be finite numbers, got {bad}")
        if self.kind == "uniform" and not self.b > self.a:
            raise InvalidArgument(f"uniform initializer needs b > a, got a={self.a} b={self.b}")
        if self.kind == "normal" and not self.b >= 0:
            raise InvalidArgument(f"normal initializer needs std b >= 0, got b={self.b}")

    def to_proto(self) -> ps_pb2.Initializer:
        """This initializer as the ps.proto message."""
        return ps_pb2.Initializer(
            kind=_PROTO_INIT[self.kind], a=self.a, b=self.b, seed=self.seed, state_init=self.state_init
        )

    @classmethod
    def from_proto(cls, msg: ps_pb2.Initializer) -> Initializer:
        """The initializer a ps.proto message describes."""
        kind = _INIT_FROM_PROTO.get(msg.kind)
        if kind is None:
            raise InvalidArgument(f"unknown initializer kind {msg.kind}")
        return cls(kind=kind, a=msg.a, b=msg.b, seed=msg.seed, state_init=msg.state_init)


def _initializer_fields(d):
    """d, if it names only Initializer's fields (Initializer(**d) would quote a stray key whole)."""
    if isinstance(d, dict) and not set(d) <= _INITIALIZER_FIELDS:
        raise InvalidArgument(f"unknown initializer field(s) {shown(sorted(map(str, set(d) - _INITIALIZER_FIELDS)))}")
    return d


_INITIALIZER_FIELDS = {f.name for f in fields(Initializer)}


@dataclass(frozen=True)
class TableSchema:
    """A table: `dim` embedding values and `state_width` optimizer-state values per row.

    expected_rows (how many rows the table is expected to hold; 0: unknown) is a sizing hint for
    the store, not part of the schema's identity: two schemas that differ only in it are equal,
    and it is left out of to_dict() (the form checkpoints and table files compare).
    """

    name: str
    dim: int
    state_width: int = 0
    dtype: str = "fp32"
    initializer: Initializer = field(default_factory=Initializer)
    expected_rows: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        check_name(self.name)
        if not isinstance(self.dim, int) or self.dim < 1:
            raise InvalidArgument(f"table {self.name!r}: dim must be an integer >= 1, got {shown(self.dim)}")
        if not isinstance(self.state_width, int) or self.state_width < 0:
            raise InvalidArgument(
                f"table {self.name!r}: state_width must be an integer >= 0, got {shown(self.state_width)}"
            )
        if self.dim + self.state_width > MAX_ROW_WIDTH:
            raise InvalidArgument(
                f"table {self.name!r}: row width {self.dim + self.state_width} exceeds {MAX_ROW_WIDTH}"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"table {self.name!r}: dtype {shown(self.dtype)} is not one of {tuple(DTYPES)}")
        if not isinstance(self.expected_rows, int) or not 0 <= self.expected_rows <= MAX_EXPECTED_ROWS:
            raise InvalidArgument(
                f"table {self.name!r}: expected_rows must be an integer in [0, 2^48 = {MAX_EXPECTED_ROWS}], "
                f"got {shown(self.expected_rows)}"
            )

    @property
    def width(self) -> int:
        """Values per row: embedding then optimizer state."""
        return self.dim + self.state_width

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype rows are stored in (bf16: uint16 bit patterns)."""
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (embedding and state)."""
        return self.width * self.np_dtype.itemsize

    def to_proto(self) -> ps_pb2.TableSpec:
        """This schema as the ps.proto message."""
        return ps_pb2.TableSpec(
            name=self.name,
            dim=self.dim,
            state_width=self.state_width,
            dtype=_PROTO_DTYPE[self.dtype],
            initializer=self.initializer.to_proto(),
            expected_rows=self.expected_rows,
        )

    @classmethod
    def from_proto(cls, msg: ps_pb2.TableSpec) -> TableSchema:
        """The schema a ps.proto message describes, checked."""
        dtype = _DTYPE_FROM_PROTO.get(msg.dtype)
        if dtype is None:
            raise InvalidArgument(
                f"table {shown(msg.name)}: dtype must be FP32, FP16 or BF16 (got enum value {msg.dtype})"
            )
        return cls(
            name=msg.name,
            dim=msg.dim,
            state_width=msg.state_width,
            dtype=dtype,
            initializer=Initializer.from_proto(msg.initializer),
            expected_rows=msg.expected_rows,
        )

    def to_dict(self) -> dict:
        """This schema as a JSON-ready dict (the form table.json and the CLI use)."""
        return {
            "name": self.name,
            "dim": self.dim,
            "state_width": self.state_width,
            "dtype": self.dtype,
            "initializer": {
                "kind": self.initializer.kind,
                "a": self.initializer.a,
                "b": self.initializer.b,
                "seed": self.initializer.seed,
                "state_init": self.initializer.state_init,
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> TableSchema:
        """The schema of a to_dict() dict, checked."""
        return cls(
            name=d["name"],
            dim=int(d["dim"]),
            state_width=int(d.get("state_width", 0)),
            dtype=d.get("dtype", "fp32"),
            initializer=Initializer(**_initializer_fields(d.get("initializer", {}))),
        )
