"""Hostile requests for the PS fuzz test (tests/ps_server/test_ps_fuzz.py), as hypothesis strategies.

A `Probe` is one RPC: a message, raw bytes, or a client stream, with what the PS may answer.
Probes that name a victim table are invalid by construction (they must fail, and leave its
rows alone); probes on the fuzzer's own scratch tables may be anything, valid or not. Bulk
bytes come from a numpy generator seeded by hypothesis, so big payloads cost one draw.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import grpc
import numpy as np
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from dynemb.protos import ps_pb2
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.wire import _varint as wire_varint

C = grpc.StatusCode
# What a PS may answer to anything; CANCELLED only where the fuzzer cancels the call itself.
ALLOWED = frozenset(
    {
        C.OK,
        C.INVALID_ARGUMENT,
        C.NOT_FOUND,
        C.ALREADY_EXISTS,
        C.RESOURCE_EXHAUSTED,
        C.FAILED_PRECONDITION,
        C.OUT_OF_RANGE,
    }
)
# The rule of dynemb/protos/ps.proto for table names.
VALID_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
REQUEST_TYPE = {m.name: getattr(ps_pb2, m.input_type.name) for m in SERVICE.methods}
MAX_MESSAGE = 1 << 20  # the fuzzed PS runs with --max-message-mb 1: oversized messages stay small


def valid_name(name: str) -> bool:
    return VALID_NAME.fullmatch(name) is not None


@dataclass
class Probe:
    method: str
    kind: str  # "unary" | "raw" | "export" | "import" | "raw_import"
    payload: object  # a message, bytes, or a list of chunks (messages or bytes)
    codes: frozenset = ALLOWED  # what the answer may be
    words: tuple = ()  # what an error's details must mention...
    words_for: grpc.StatusCode | None = None  # ...when it is this error (None: any but CANCELLED)
    cancel_after: int | None = None  # streams: cancel after this many chunks
    note: str = ""

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis prints a failing example
        printer.text(repr(self))

    def __repr__(self) -> str:  # payloads can be megabytes: show their shape only
        def show(p):
            if isinstance(p, bytes):
                return f"<{len(p)} bytes {p[:24]!r}>"
            if isinstance(p, list):
                return "[" + ", ".join(show(c) for c in p) + "]"
            return f"<{type(p).__name__} {p.ByteSize()} bytes>"

        codes = sorted(c.name for c in self.codes)
        return (
            f"Probe({self.method} {self.kind} {self.note!r} payload={show(self.payload)} codes={codes} "
            f"words={self.words} cancel_after={self.cancel_after})"
        )


@dataclass
class Tables:
    """The victim schemas (their rows must survive) and the scratch names the fuzzer may use."""

    victims: list[TableSchema]
    scratch: list[str] = field(default_factory=lambda: ["fz_0", "fz_1", "fz-2.x"])

    @property
    def victim_names(self) -> set[str]:
        return {v.name for v in self.victims}


def _rng(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _blob(rng: np.random.Generator, n: int) -> bytes:
    return rng.bytes(n)


def _ids(rng: np.random.Generator, n: int) -> bytes:
    """n int64 ids, some small, some extreme (0, -1, int64 min/max), some repeated."""
    pool = np.array([0, -1, 1, -(1 << 63), (1 << 63) - 1, 42], dtype=np.int64)
    ids = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64, endpoint=True)
    small = rng.random(n) < 0.5
    ids[small] = rng.integers(0, 300, int(small.sum()))  # overlaps the victims' ids
    pick = rng.random(n) < 0.1
    ids[pick] = rng.choice(pool, int(pick.sum()))
    return ids.astype("<i8").tobytes()


# sizes around the edges: empty, a few, not a multiple of 8, around the message limit
SIZES = st.one_of(st.integers(0, 48), st.sampled_from([7, 9, 63, 65, 1023, 4096, 65535, 65536, 262145]))
UINT32_EDGES = st.one_of(
    st.integers(0, 9), st.sampled_from([65535, 65536, 65537, 1 << 31, 2**32 - 1]), st.integers(0, 2**32 - 1)
)
UINT64_EDGES = st.one_of(st.integers(0, 9), st.sampled_from([1 << 63, 2**64 - 1]), st.integers(0, 2**64 - 1))
ENUMS = st.one_of(st.integers(-1, 5), st.sampled_from([-(2**31), 2**31 - 1, 99]))
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
BAD_PARTS = [" ", "\n", "\r\n", "\x00", "/", "é", "*", "{x}", ":", "\t", "\u202e", "ß", "🙂", "'", '"']


def invalid_names(tables: Tables) -> st.SearchStrategy[str]:
    known = st.sampled_from([v.name for v in tables.victims] + tables.scratch)
    part = st.sampled_from(BAD_PARTS)
    return st.one_of(
        st.just(""),
        st.builds(lambda n, p: n + p, known, part),
        st.builds(lambda p, n: p + n, part, known),
        st.builds(lambda n, p, k: n[:k] + p + n[k:], known, part, st.integers(1, 4)),
        st.builds(lambda k: "a" * k, st.sampled_from([129, 130, 1000, 20_000])),
        st.text(min_size=1, max_size=12).filter(lambda s: not valid_name(s)),
    )


def scratch_names(tables: Tables) -> st.SearchStrategy[str]:
    """Names the fuzzer may create, write and drop: never a victim's."""
    return st.one_of(
        st.sampled_from(tables.scratch),
        st.text(max_size=12).filter(lambda s: s not in tables.victim_names),
        invalid_names(tables),
    )


@st.composite
def _bytes_field(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=24))
    return _blob(_rng(draw), draw(SIZES))


def _field(f: FieldDescriptor, names) -> st.SearchStrategy:
    if f.type == FieldDescriptor.TYPE_STRING:
        return names
    if f.type == FieldDescriptor.TYPE_BYTES:
        return _bytes_field()
    if f.type == FieldDescriptor.TYPE_UINT32:
        return UINT32_EDGES
    if f.type == FieldDescriptor.TYPE_UINT64:
        return UINT64_EDGES
    if f.type == FieldDescriptor.TYPE_DOUBLE:
        return DOUBLES
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type == FieldDescriptor.TYPE_ENUM:
        return ENUMS
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if f.is_repeated:  # PullMany's pulls, PushMany's pushes
            return st.lists(any_message(f.message_type, names), max_size=3)
        return any_message(f.message_type, names)
    raise AssertionError(f"no strategy for field {f.full_name}")


def any_message(descriptor, names) -> st.SearchStrategy:
    """A message of this type with any subset of its fields set to hostile values (from the
    descriptor, so a field added to dynemb/protos/ps.proto is fuzzed too)."""
    cls = message_factory.GetMessageClass(descriptor)
    fields = {f.name: _field(f, names) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def _table_of(method: str, msg) -> str | None:
    if method == "CreateTable":
        return msg.spec.name if msg.HasField("spec") else None
    return getattr(msg, "table", None)


def _tables_of(method: str, msg) -> list[str]:
    """Every table a request names (the many-table ones name one per entry)."""
    if method in ("PullMany", "PushMany"):
        return [entry.table for entry in (msg.pulls if method == "PullMany" else msg.pushes)]
    table = _table_of(method, msg)
    return [] if table is None else [table]


@st.composite
def generic_probe(draw, tables: Tables) -> Probe:
    """Any request message of any method, every field drawn from hostile values."""
    method = draw(st.sampled_from(sorted(REQUEST_TYPE)))
    names = scratch_names(tables)
    if method == "Import":
        chunks = draw(st.lists(any_message(ps_pb2.RowChunk.DESCRIPTOR, names), min_size=1, max_size=3))
        return Probe(method, "import", chunks, note="generic chunks")
    msg = draw(any_message(REQUEST_TYPE[method].DESCRIPTOR, names))
    table = _table_of(method, msg)
    if method in ("PullMany", "PushMany"):
        # every entry's name is checked before anything else: one invalid name anywhere refuses
        # the whole call, as such
        if not all(valid_name(t) for t in _tables_of(method, msg)):
            return Probe(method, "unary", msg, frozenset({C.INVALID_ARGUMENT}), ("table name",), note="generic many")
        return Probe(method, "unary", msg, note="generic many")
    if table is not None and not valid_name(table):
        # the name is checked first by every method that takes one
        words = ("table name",) if method != "CreateTable" else ()
        return Probe(
            method,
            "export" if method == "Export" else "unary",
            msg,
            frozenset({C.INVALID_ARGUMENT}),
            words,
            note="invalid name",
        )
    return Probe(method, "export" if method == "Export" else "unary", msg, note="generic")


def _spec_variants(v: TableSchema):
    """(spec, code, words): specs named like victim v that CreateTable/Import must refuse."""
    base = v.to_proto()

    def with_(**kw):
        s = ps_pb2.TableSpec()
        s.CopyFrom(base)
        init = kw.pop("initializer", None)
        for k, val in kw.items():
            setattr(s, k, val)
        if init:
            for k, val in init.items():
                setattr(s.initializer, k, val)
        return s

    other_dtype = {ps_pb2.FP32: ps_pb2.FP16, ps_pb2.FP16: ps_pb2.BF16, ps_pb2.BF16: ps_pb2.FP32}[base.dtype]
    clash = (C.ALREADY_EXISTS, ("another schema",))
    bad = C.INVALID_ARGUMENT
    return [
        (with_(dim=v.dim + 1), *clash),
        (with_(state_width=v.state_width + 3), *clash),
        (with_(dtype=other_dtype), *clash),
        (with_(initializer={"seed": v.initializer.seed + 1}), *clash),
        (with_(dim=0), bad, ("dim",)),
        (with_(dim=65536, state_width=1), bad, ("65536",)),
        (with_(state_width=2**32 - 1), bad, ("exceeds",)),
        (with_(dtype=7), bad, ("dtype",)),
        (with_(dtype=-3), bad, ("dtype",)),
        (with_(initializer={"kind": 9}), bad, ("initializer kind",)),
        (with_(initializer={"kind": ps_pb2.Initializer.UNIFORM, "a": 1.0, "b": 1.0}), bad, ("b > a",)),
        (with_(initializer={"kind": ps_pb2.Initializer.NORMAL, "b": -1.0}), bad, ("std",)),
        (with_(initializer={"a": math.nan}), bad, ("finite",)),
        (with_(initializer={"kind": ps_pb2.Initializer.UNIFORM, "a": -math.inf, "b": 0.0}), bad, ("finite",)),
        (with_(initializer={"state_init": math.inf}), bad, ("finite",)),
    ]


def _bad_rows_size(rng, v: TableSchema, n: int) -> int:
    """A row byte count that is NOT n rows of v (wrong dtype, width off by one, truncated...)."""
    right = n * v.row_bytes
    other_itemsize = 4 if v.np_dtype.itemsize == 2 else 2
    options = [
        n * v.width * other_itemsize,
        right + 1,
        right - 1,
        right + v.row_bytes,
        right - v.row_bytes,
        n * (v.width + 1) * v.np_dtype.itemsize,
        n * (v.width - 1) * v.np_dtype.itemsize,
        0,
        int(rng.integers(0, 4 * right + 64)),
    ]
    options = [s for s in options if s >= 0 and s != right]
    return int(rng.choice(options))


@st.composite
def victim_probe(draw, tables: Tables) -> Probe:
    """An invalid request that names a victim table: it must fail and change nothing."""
    v = draw(st.sampled_from(tables.victims))
    rng = _rng(draw)
    what = draw(
        st.sampled_from(["push_rows", "ids_not_8", "spec", "bad_name", "other_name", "import", "pull_too_many"])
    )
    n = draw(st.integers(0, 40))
    if what == "push_rows":
        if n == 0:
            n = 1
        rows = _blob(rng, _bad_rows_size(rng, v, n))
        return Probe(
            "Push",
            "unary",
            ps_pb2.PushRequest(table=v.name, ids=_ids(rng, n), rows=rows),
            frozenset({C.INVALID_ARGUMENT}),
            (v.name, "bytes"),
            note="rows not n x row size",
        )
    if what == "ids_not_8":
        ids = _ids(rng, n) + _blob(rng, draw(st.integers(1, 7)))
        method = draw(st.sampled_from(["Push", "Pull", "Delete"]))
        msg = REQUEST_TYPE[method](table=v.name, ids=ids)
        if method == "Push":
            msg.rows = _blob(rng, n * v.row_bytes)
        return Probe(
            method,
            "unary",
            msg,
            frozenset({C.INVALID_ARGUMENT}),
            ("multiple of 8",),
            note="id bytes not a multiple of 8",
        )
    if what == "pull_too_many":  # a reply over the limit from a request under it: rows wider than ids
        v = draw(st.sampled_from([t for t in tables.victims if t.row_bytes >= 16]))
        k = MAX_MESSAGE // v.row_bytes + draw(st.integers(1, 1000))  # the rows alone are over the limit
        return Probe(
            "Pull",
            "unary",
            ps_pb2.PullRequest(table=v.name, ids=_ids(rng, k)),
            frozenset({C.RESOURCE_EXHAUSTED}),
            ("max message size",),
            note="reply too big",
        )
    if what == "spec":
        spec, code, words = draw(st.sampled_from(_spec_variants(v)))
        return Probe(
            "CreateTable",
            "unary",
            ps_pb2.CreateTableRequest(spec=spec),
            frozenset({code}),
            words,
            note="clashing or invalid spec",
        )
    if what in ("bad_name", "other_name"):
        if what == "bad_name":
            name, codes, words = draw(invalid_names(tables)), frozenset({C.INVALID_ARGUMENT}), ("table name",)
        else:  # a valid name that only looks like the victim's
            name = draw(st.sampled_from([v.name.upper(), v.name + "_", "_" + v.name, v.name[:-1], v.name + ".0"]))
            codes, words = frozenset({C.NOT_FOUND}), (name,)
        method = draw(st.sampled_from(["DescribeTable", "DropTable", "Pull", "Push", "Delete", "Export"]))
        msg = REQUEST_TYPE[method](table=name)
        if method in ("Pull", "Push", "Delete"):
            msg.ids = _ids(rng, n)
        if method == "Push":
            msg.rows = _blob(rng, n * v.row_bytes)
        return Probe(method, "export" if method == "Export" else "unary", msg, codes, words, note=f"name {what}")
    # an import whose first chunk is refused, so nothing after it is read
    first_kind = draw(st.sampled_from(["no_spec", "spec", "rows", "ids"]))
    replace = draw(st.booleans())
    first = ps_pb2.RowChunk(replace=replace)
    codes, words = frozenset({C.INVALID_ARGUMENT}), ()
    if first_kind == "no_spec":
        first.ids = _ids(rng, n)
        first.rows = _blob(rng, n * v.row_bytes)
        words = ("spec",)
    elif first_kind == "spec":
        spec, code, words = draw(st.sampled_from(_spec_variants(v)))
        first.spec.CopyFrom(spec)
        codes = frozenset({code})
    else:  # the victim's very spec, with rows or ids that do not fit it
        first.spec.CopyFrom(v.to_proto())
        m = max(n, 1)
        if first_kind == "rows":
            first.ids, first.rows, words = _ids(rng, m), _blob(rng, _bad_rows_size(rng, v, m)), ("bytes",)
        else:
            first.ids = _ids(rng, m) + b"\x01"
            first.rows, words = _blob(rng, m * v.row_bytes), ("multiple of 8",)
    # later chunks would be valid rows for the victim: they must never be applied
    later = [
        ps_pb2.RowChunk(ids=_ids(rng, 3), rows=_blob(rng, 3 * v.row_bytes)) for _ in range(draw(st.integers(0, 3)))
    ]
    cut = draw(st.one_of(st.none(), st.integers(1, 1 + len(later))))
    if cut is not None:
        codes = codes | {C.CANCELLED}
    return Probe(
        "Import",
        "import",
        [first, *later],
        codes,
        words,
        cancel_after=cut,
        note=f"import, bad first chunk ({first_kind})",
    )


def _mutate(rng, data: bytes) -> bytes:
    """Bit flips, a cut, a splice of garbage: a serialized message made (usually) invalid."""
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 4))
        if op == 0 and b:
            i = int(rng.integers(0, len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1 and b:
            del b[int(rng.integers(0, len(b))) :]
        elif op == 2:
            i = int(rng.integers(0, len(b) + 1))
            b[i:i] = rng.bytes(int(rng.integers(1, 12)))
        else:
            b[0:0] = bytes([int(rng.integers(0, 256))])
    return bytes(b)


def _varint(n: int) -> bytes:
    return wire_varint(n & ((1 << 64) - 1))  # negative numbers travel as 10-byte two's-complement varints


def _negative_spec(rng, name: str) -> bytes:
    """CreateTableRequest bytes whose spec has negative dim/state_width/dtype/kind: what the
    generated code refuses to write, a hostile client can still send."""
    init = b"\x08" + _varint(-int(rng.integers(1, 1 << 31)))  # kind
    spec = (
        b"\x0a"
        + _varint(len(name.encode()))
        + name.encode()
        + b"\x10"
        + _varint(-int(rng.integers(1, 1 << 31)))  # dim
        + b"\x18"
        + _varint(-int(rng.integers(0, 1 << 31)))  # state_width
        + b"\x20"
        + _varint(-int(rng.integers(1, 4)))  # dtype
        + b"\x2a"
        + _varint(len(init))
        + init
    )
    return b"\x0a" + _varint(len(spec)) + spec


def _parses_to_victim(method: str, data: bytes, tables: Tables) -> bool | None:
    """None: not a valid message; else whether the decoded request names a victim."""
    try:
        msg = REQUEST_TYPE[method].FromString(data)
    except DecodeError:
        return None
    if method == "Import":
        return msg.HasField("spec") and msg.spec.name in tables.victim_names
    return any(t in tables.victim_names for t in _tables_of(method, msg))


@st.composite
def raw_probe(draw, tables: Tables) -> Probe | None:
    """Bytes that are not (or not quite) a serialized request, sent with identity serializers."""
    rng = _rng(draw)
    how = draw(st.sampled_from(["garbage", "mutated", "negative", "wrong_wire_type"]))
    method = draw(st.sampled_from(sorted(REQUEST_TYPE)))
    if how == "garbage":
        data = draw(st.binary(min_size=1, max_size=24)) if draw(st.booleans()) else _blob(rng, draw(SIZES) + 1)
    elif how == "mutated":
        msg = draw(any_message(REQUEST_TYPE[method].DESCRIPTOR, scratch_names(tables)))
        data = _mutate(rng, msg.SerializeToString())
    elif how == "negative":
        method, data = "CreateTable", _negative_spec(rng, draw(st.sampled_from(tables.scratch)))
    else:  # field 1 (a string or a message in every request) sent as a varint, field 2 as fixed64
        data = b"\x08" + _varint(int(rng.integers(0, 1 << 40))) + b"\x11" + _blob(rng, 8)
    if len(data) > MAX_MESSAGE:
        data = data[:MAX_MESSAGE]
    names_victim = _parses_to_victim(method, data, tables)
    if names_victim:
        return None  # a mutation that decodes to a request on a victim might be valid: not sent
    if names_victim is None:
        codes, words = frozenset({C.INVALID_ARGUMENT}), ("not a valid",)
    elif how == "negative":
        codes, words = frozenset({C.INVALID_ARGUMENT}), ()
    else:
        codes, words = ALLOWED, ()
    if method == "Import":
        # garbage among chunks of a stream: later chunks garbage, the first maybe a real one
        spec = ps_pb2.TableSpec(name=draw(st.sampled_from(tables.scratch)), dim=2, dtype=ps_pb2.FP32)
        if draw(st.booleans()):
            return Probe(method, "raw_import", [data], codes, words, note=f"raw {how}")
        # the first chunk creates a scratch table (or clashes with one), then the garbage
        chunks = [ps_pb2.RowChunk(spec=spec).SerializeToString(), data]
        if names_victim is None:
            codes = frozenset({C.INVALID_ARGUMENT, C.ALREADY_EXISTS})
        return Probe(
            method,
            "raw_import",
            chunks,
            codes,
            words,
            words_for=C.INVALID_ARGUMENT,
            note=f"raw {how} after a good chunk",
        )
    return Probe(method, "raw", data, codes, words, note=f"raw {how}")


def _scratch_spec(draw, name: str) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(
        name=name,
        dim=draw(st.integers(1, 9)),
        state_width=draw(st.integers(0, 3)),
        dtype=draw(st.sampled_from([ps_pb2.FP32, ps_pb2.FP16, ps_pb2.BF16])),
        initializer=ps_pb2.Initializer(
            kind=draw(st.sampled_from([0, 1, 2, 3, 4])), a=-0.5, b=0.5, seed=draw(st.integers(0, 3))
        ),
    )


def _row_bytes(spec: ps_pb2.TableSpec) -> int:
    return (spec.dim + spec.state_width) * (4 if spec.dtype == ps_pb2.FP32 else 2)


@st.composite
def scratch_probe(draw, tables: Tables) -> Probe:
    """Well-formed (or nearly) traffic on scratch tables, so valid paths and stored rows get
    fuzzed too: create, push, pull, delete, exports abandoned mid-way, imports cut or
    inconsistent."""
    rng = _rng(draw)
    name = draw(st.sampled_from(tables.scratch))
    spec = _scratch_spec(draw, name)
    n = draw(st.integers(0, 300))
    what = draw(
        st.sampled_from(
            [
                "create",
                "push",
                "pull",
                "delete",
                "export_cut",
                "import",
                "import_cut",
                "import_inconsistent",
                "drop",
                "oversized",
            ]
        )
    )
    if what == "oversized" and draw(st.integers(0, 9)):
        # grpc takes 0.1-0.6 s to refuse an oversized message: a few dozen per run, not hundreds
        what = "push"
    if what == "create":
        return Probe("CreateTable", "unary", ps_pb2.CreateTableRequest(spec=spec), note="scratch create")
    if what == "push":
        return Probe(
            "Push",
            "unary",
            ps_pb2.PushRequest(table=name, ids=_ids(rng, n), rows=_blob(rng, n * _row_bytes(spec))),
            note="scratch push",
        )
    if what in ("pull", "delete"):
        method = what.capitalize()
        return Probe(method, "unary", REQUEST_TYPE[method](table=name, ids=_ids(rng, n)), note=f"scratch {what}")
    if what == "drop":
        return Probe(
            "DropTable",
            "unary",
            ps_pb2.DropTableRequest(table=name, missing_ok=draw(st.booleans())),
            note="scratch drop",
        )
    if what == "export_cut":
        # a victim's export is read-only: abandoning it half-way must not disturb it either
        table = draw(st.sampled_from([name, *sorted(tables.victim_names)]))
        return Probe(
            "Export",
            "export",
            ps_pb2.ExportRequest(table=table, rows_per_chunk=draw(st.integers(1, 7))),
            ALLOWED | {C.CANCELLED},
            cancel_after=draw(st.integers(0, 3)),
            note="export abandoned",
        )
    if what == "oversized":
        size = MAX_MESSAGE + draw(st.integers(1, 65536))
        method = draw(st.sampled_from(["Push", "Pull", "CreateTable", "Import"]))
        if method == "Push":
            msg = ps_pb2.PushRequest(
                table=draw(st.sampled_from(sorted(tables.victim_names))), ids=b"", rows=_blob(rng, size)
            )
        elif method == "Pull":
            msg = ps_pb2.PullRequest(table=name, ids=_blob(rng, size // 8 * 8 + 8))
        elif method == "CreateTable":
            msg = ps_pb2.CreateTableRequest(spec=ps_pb2.TableSpec(name="a" * size, dim=1, dtype=ps_pb2.FP32))
        else:
            chunks = [ps_pb2.RowChunk(spec=spec), ps_pb2.RowChunk(ids=_blob(rng, size // 8 * 8 + 8))]
            # the first chunk may clash with a scratch table of that name before the big one arrives
            return Probe(
                "Import",
                "import",
                chunks,
                frozenset({C.RESOURCE_EXHAUSTED, C.ALREADY_EXISTS}),
                ("larger than max",),
                words_for=C.RESOURCE_EXHAUSTED,
                note="oversized chunk",
            )
        return Probe(
            method, "unary", msg, frozenset({C.RESOURCE_EXHAUSTED}), ("larger than max",), note="oversized message"
        )
    # imports into a scratch table
    k = draw(st.integers(1, 4))
    chunks = [ps_pb2.RowChunk(spec=spec, replace=draw(st.booleans()))]
    for _ in range(k):
        m = draw(st.integers(0, 50))
        chunks.append(ps_pb2.RowChunk(ids=_ids(rng, m), rows=_blob(rng, m * _row_bytes(spec))))
    if what == "import_inconsistent":
        i = draw(st.integers(1, k))
        broken = draw(st.sampled_from(["other_spec", "rows", "ids"]))
        if broken == "other_spec":
            other = ps_pb2.TableSpec()
            other.CopyFrom(spec)
            other.dim += 1
            chunks[i].spec.CopyFrom(other)
        elif broken == "rows":
            chunks[i].rows += b"\x00"
        else:
            chunks[i].ids += b"\x00"
        return Probe("Import", "import", chunks, ALLOWED - {C.OK}, note=f"import with a bad chunk ({broken})")
    cut = draw(st.integers(0, k)) if what == "import_cut" else None
    return Probe(
        "Import", "import", chunks, ALLOWED | ({C.CANCELLED} if cut is not None else set()), cancel_after=cut, note=what
    )


def probes(tables: Tables) -> st.SearchStrategy:
    return st.one_of(generic_probe(tables), victim_probe(tables), raw_probe(tables), scratch_probe(tables))
