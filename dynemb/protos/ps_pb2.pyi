from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FP32: _ClassVar[DType]
    FP16: _ClassVar[DType]
    BF16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FP32: DType
FP16: DType
BF16: DType

class Initializer(_message.Message):
    __slots__ = ("kind", "a", "b", "seed", "state_init")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Initializer.Kind]
        ZEROS: _ClassVar[Initializer.Kind]
        CONSTANT: _ClassVar[Initializer.Kind]
        UNIFORM: _ClassVar[Initializer.Kind]
        NORMAL: _ClassVar[Initializer.Kind]
    KIND_UNSPECIFIED: Initializer.Kind
    ZEROS: Initializer.Kind
    CONSTANT: Initializer.Kind
    UNIFORM: Initializer.Kind
    NORMAL: Initializer.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STATE_INIT_FIELD_NUMBER: _ClassVar[int]
    kind: Initializer.Kind
    a: float
    b: float
    seed: int
    state_init: float
    def __init__(self, kind: _Optional[_Union[Initializer.Kind, str]] = ..., a: _Optional[float] = ..., b: _Optional[float] = ..., seed: _Optional[int] = ..., state_init: _Optional[float] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "state_width", "dtype", "initializer", "expected_rows", "lifecycle", "change_log")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    CHANGE_LOG_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    state_width: int
    dtype: DType
    initializer: Initializer
    expected_rows: int
    lifecycle: Lifecycle
    change_log: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., state_width: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., initializer: _Optional[_Union[Initializer, _Mapping]] = ..., expected_rows: _Optional[int] = ..., lifecycle: _Optional[_Union[Lifecycle, _Mapping]] = ..., change_log: _Optional[int] = ...) -> None: ...

class Lifecycle(_message.Message):
    __slots__ = ("ttl_s", "max_rows", "touch_every_s", "since")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOUCH_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    ttl_s: int
    max_rows: int
    touch_every_s: int
    since: int
    def __init__(self, ttl_s: _Optional[int] = ..., max_rows: _Optional[int] = ..., touch_every_s: _Optional[int] = ..., since: _Optional[int] = ...) -> None: ...

class LastSweep(_message.Message):
    __slots__ = ("finished", "seconds", "scanned", "deleted", "rows_over_cap")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCANNED_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    ROWS_OVER_CAP_FIELD_NUMBER: _ClassVar[int]
    finished: float
    seconds: float
    scanned: int
    deleted: int
    rows_over_cap: int
    def __init__(self, finished: _Optional[float] = ..., seconds: _Optional[float] = ..., scanned: _Optional[int] = ..., deleted: _Optional[int] = ..., rows_over_cap: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("spec", "num_rows", "last_sweep", "expired_reads")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_SWEEP_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_READS_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    num_rows: int
    last_sweep: LastSweep
    expired_reads: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., num_rows: _Optional[int] = ..., last_sweep: _Optional[_Union[LastSweep, _Mapping]] = ..., expired_reads: _Optional[int] = ...) -> None: ...

class SetChangeLogRequest(_message.Message):
    __slots__ = ("table", "max_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    max_ids: int
    def __init__(self, table: _Optional[str] = ..., max_ids: _Optional[int] = ...) -> None: ...

class ReadChangesRequest(_message.Message):
    __slots__ = ("table", "after", "limit")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    table: str
    after: str
    limit: int
    def __init__(self, table: _Optional[str] = ..., after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ReadChangesResponse(_message.Message):
    __slots__ = ("ids", "times", "cursor", "gap")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    times: bytes
    cursor: str
    gap: bool
    def __init__(self, ids: _Optional[bytes] = ..., times: _Optional[bytes] = ..., cursor: _Optional[str] = ..., gap: _Optional[bool] = ...) -> None: ...

class SetLifecycleRequest(_message.Message):
    __slots__ = ("table", "lifecycle")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    lifecycle: Lifecycle
    def __init__(self, table: _Optional[str] = ..., lifecycle: _Optional[_Union[Lifecycle, _Mapping]] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ("rows_stored", "touch_every_s")
    ROWS_STORED_FIELD_NUMBER: _ClassVar[int]
    TOUCH_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    rows_stored: int
    touch_every_s: int
    def __init__(self, rows_stored: _Optional[int] = ..., touch_every_s: _Optional[int] = ...) -> None: ...

class ReadDeletionsRequest(_message.Message):
    __slots__ = ("table", "after", "limit")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    table: str
    after: str
    limit: int
    def __init__(self, table: _Optional[str] = ..., after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ReadDeletionsResponse(_message.Message):
    __slots__ = ("ids", "times", "cursor", "gap")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    times: bytes
    cursor: str
    gap: bool
    def __init__(self, ids: _Optional[bytes] = ..., times: _Optional[bytes] = ..., cursor: _Optional[str] = ..., gap: _Optional[bool] = ...) -> None: ...

class ReadDropsRequest(_message.Message):
    __slots__ = ("after", "limit")
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    after: str
    limit: int
    def __init__(self, after: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class DroppedTable(_message.Message):
    __slots__ = ("table", "time")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    table: str
    time: float
    def __init__(self, table: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class ReadDropsResponse(_message.Message):
    __slots__ = ("drops", "cursor", "gap")
    DROPS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    drops: _containers.RepeatedCompositeFieldContainer[DroppedTable]
    cursor: str
    gap: bool
    def __init__(self, drops: _Optional[_Iterable[_Union[DroppedTable, _Mapping]]] = ..., cursor: _Optional[str] = ..., gap: _Optional[bool] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("table", "created")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    table: TableInfo
    created: bool
    def __init__(self, table: _Optional[_Union[TableInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("table", "missing_ok")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    table: str
    missing_ok: bool
    def __init__(self, table: _Optional[str] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ("dropped", "rows_dropped")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ROWS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    rows_dropped: int
    def __init__(self, dropped: _Optional[bool] = ..., rows_dropped: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("table", "ids", "rows_to")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_TO_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    rows_to: SegmentRef
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., rows_to: _Optional[_Union[SegmentRef, _Mapping]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("rows", "missing", "num_missing")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSING_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    missing: bytes
    num_missing: int
    def __init__(self, rows: _Optional[bytes] = ..., missing: _Optional[bytes] = ..., num_missing: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "ids", "rows", "rows_from")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FROM_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    rows: bytes
    rows_from: SegmentRef
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., rows_from: _Optional[_Union[SegmentRef, _Mapping]] = ...) -> None: ...

class SegmentRef(_message.Message):
    __slots__ = ("segment", "offset", "size")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    segment: int
    offset: int
    size: int
    def __init__(self, segment: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class AttachSegmentRequest(_message.Message):
    __slots__ = ("path", "size", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    token: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class AttachSegmentResponse(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: int
    def __init__(self, segment: _Optional[int] = ...) -> None: ...

class DetachSegmentRequest(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: int
    def __init__(self, segment: _Optional[int] = ...) -> None: ...

class DetachSegmentResponse(_message.Message):
    __slots__ = ("detached",)
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    detached: bool
    def __init__(self, detached: _Optional[bool] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("rows_written",)
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    rows_written: int
    def __init__(self, rows_written: _Optional[int] = ...) -> None: ...

class PullManyRequest(_message.Message):
    __slots__ = ("pulls",)
    PULLS_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ...) -> None: ...

class PullManyResponse(_message.Message):
    __slots__ = ("pulls",)
    PULLS_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullResponse]
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ...) -> None: ...

class PushManyRequest(_message.Message):
    __slots__ = ("pushes",)
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[PushRequest]
    def __init__(self, pushes: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ...) -> None: ...

class PushManyResponse(_message.Message):
    __slots__ = ("pushes",)
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[PushResponse]
    def __init__(self, pushes: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("rows_deleted",)
    ROWS_DELETED_FIELD_NUMBER: _ClassVar[int]
    rows_deleted: int
    def __init__(self, rows_deleted: _Optional[int] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("table", "rows_per_chunk")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows_per_chunk: int
    def __init__(self, table: _Optional[str] = ..., rows_per_chunk: _Optional[int] = ...) -> None: ...

class RowChunk(_message.Message):
    __slots__ = ("spec", "ids", "rows", "replace")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    ids: bytes
    rows: bytes
    replace: bool
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., replace: _Optional[bool] = ...) -> None: ...

class ImportResponse(_message.Message):
    __slots__ = ("table", "rows_written")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    table: TableInfo
    rows_written: int
    def __init__(self, table: _Optional[_Union[TableInfo, _Mapping]] = ..., rows_written: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MethodStats(_message.Message):
    __slots__ = ("method", "requests", "errors", "rows")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    method: str
    requests: int
    errors: int
    rows: int
    def __init__(self, method: _Optional[str] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("backend", "version", "uptime_seconds", "tables", "methods")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    version: str
    uptime_seconds: float
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    methods: _containers.RepeatedCompositeFieldContainer[MethodStats]
    def __init__(self, backend: _Optional[str] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., methods: _Optional[_Iterable[_Union[MethodStats, _Mapping]]] = ...) -> None: ...
