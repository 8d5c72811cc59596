"""Bad input through a real PS: the right status, a message that names the problem, the
server still serving, and nothing stored changed."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from helpers import pause, wait_until
from ps_procs import wait_for_health

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.client import PSClient, RetryPolicy
from dynemb.ps_server.entries import parse_row_entries
from dynemb.ps_server.errors import InvalidArgument, TableExists, TableNotFound, Unavailable
from dynemb.ps_server.metrics import PSMetrics
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.service import ParameterServerService
from dynemb.ps_server.wire import parse_push_request


@pytest.fixture
def stored(embedded_ps, request):
    """A table with known rows, and a raw stub that bypasses every client-side check."""
    table = f"bad_{request.node.name[:40].replace('[', '_').replace(']', '')}"
    ids = np.arange(100, dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float32)
    with PSClient(embedded_ps.address) as ps:
        ps.create_table(table, dim=4, state_width=2)
        ps.push(table, ids, rows)
        channel = grpc.insecure_channel(embedded_ps.address, options=[("grpc.max_send_message_length", 64 << 20)])
        yield ps, ps_pb2_grpc.ParameterServerStub(channel), table, ids, rows
        # the server kept serving, and the rows are as they were
        got = ps.pull(table, ids)
        assert np.array_equal(got.rows, rows) and not got.missing.any()
        channel.close()


def status_of(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value


def test_wrong_row_width(stored):
    ps, stub, table, ids, rows = stored
    err = status_of(stub.Push, ps_pb2.PushRequest(table=table, ids=ids[:2].tobytes(), rows=rows[:2, :5].tobytes()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 ids x 6 values" in err.details() and table in err.details()
    with pytest.raises(InvalidArgument, match="6"):
        ps.push(table, ids[:2], rows[:2, :5])


def test_id_bytes_not_a_multiple_of_8(stored):
    _, stub, table, ids, _ = stored
    for call, req in (
        (stub.Pull, ps_pb2.PullRequest(table=table, ids=ids[:3].tobytes()[:-3])),
        (stub.Delete, ps_pb2.DeleteRequest(table=table, ids=b"\x01" * 9)),
    ):
        err = status_of(call, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "multiple of 8" in err.details()


def test_row_bytes_not_ids_times_width(stored):
    _, stub, table, ids, rows = stored
    err = status_of(stub.Push, ps_pb2.PushRequest(table=table, ids=ids[:4].tobytes(), rows=rows[:3].tobytes()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{4 * 6 * 4} bytes" in err.details() and f"got {3 * 6 * 4} bytes" in err.details()


def test_unknown_table(stored):
    ps, stub, _, ids, _ = stored
    for call, req in (
        (stub.Pull, ps_pb2.PullRequest(table="no_such", ids=ids.tobytes())),
        (stub.DescribeTable, ps_pb2.DescribeTableRequest(table="no_such")),
        (stub.DropTable, ps_pb2.DropTableRequest(table="no_such")),
    ):
        err = status_of(call, req)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "no_such" in err.details()
    with pytest.raises(TableNotFound, match="no_such"):
        ps.pull("no_such", ids)
    assert ps.drop_table("no_such", missing_ok=True) == 0


def test_create_existing_with_another_schema(stored):
    ps, _, table, _, _ = stored
    assert ps.create_table(table, dim=4, state_width=2).num_rows == 100  # same schema: fine
    with pytest.raises(TableExists, match="another schema") as info:
        ps.create_table(table, dim=8, state_width=2)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(TableExists):
        ps.create_table(table, dim=4, state_width=2, dtype="fp16")


def test_bad_specs(stored):
    _, stub, _, _, _ = stored

    def with_init(**initializer) -> ps_pb2.TableSpec:  # a good spec but for its initializer
        return ps_pb2.TableSpec(name="x", dim=4, dtype=ps_pb2.FP32, initializer=ps_pb2.Initializer(**initializer))

    for spec, words in (
        (ps_pb2.TableSpec(name="x", dim=0, dtype=ps_pb2.FP32), "dim"),
        (ps_pb2.TableSpec(name="has space", dim=4, dtype=ps_pb2.FP32), "table name"),
        (ps_pb2.TableSpec(name="x", dim=4), "dtype"),
        (with_init(kind=ps_pb2.Initializer.UNIFORM, a=1, b=0), "b > a"),
        # NaN made a schema unequal to itself: the second create of one table said "another schema"
        (with_init(kind=ps_pb2.Initializer.CONSTANT, a=float("nan")), "finite"),
        (with_init(kind=ps_pb2.Initializer.UNIFORM, a=float("-inf")), "finite"),
        (with_init(state_init=float("inf")), "'state_init': inf"),
        # `$` in the name pattern matched before a final newline
        (ps_pb2.TableSpec(name="x\n", dim=4, dtype=ps_pb2.FP32), "table name"),
    ):
        err = status_of(stub.CreateTable, ps_pb2.CreateTableRequest(spec=spec))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


def test_oversized_messages(make_ps):
    proc = make_ps("--max-message-mb", "1")
    with PSClient(proc.address) as ps:
        ps.create_table("big", dim=64)
        ids = np.arange(6000, dtype=np.int64)
        rows = np.ones((len(ids), 64), np.float32)  # 1.5 MiB
        channel = grpc.insecure_channel(
            proc.address,
            options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)],
        )
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        err = status_of(stub.Push, ps_pb2.PushRequest(table="big", ids=ids.tobytes(), rows=rows.tobytes()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = status_of(stub.Pull, ps_pb2.PullRequest(table="big", ids=ids.tobytes()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max message size" in err.details() and "6000 rows" in err.details()
        assert ps.describe_table("big").num_rows == 0
        # the client cuts the same batch under the limit
        with PSClient(proc.address, max_message_bytes=1 << 20) as small:
            small.push("big", ids, rows)
            assert np.array_equal(small.pull("big", ids).rows, rows)
        channel.close()


@pytest.mark.slow
def test_redis_down_then_back(redis_process, make_ps):
    # an append-only file, so what was stored before the outage is there again after it
    redis_proc = redis_process(["appendonly yes", "appendfsync always"])
    proc = make_ps("--backend", redis_proc.url, "--namespace", "down", "--backend-check-seconds", "0.2")
    no_retry = RetryPolicy(attempts=1)
    ids = np.arange(50, dtype=np.int64)
    rows = np.random.default_rng(1).standard_normal((50, 2)).astype(np.float32)
    with PSClient(proc.address, retry=no_retry, timeout=20) as ps:
        ps.create_table("t", dim=2)
        ps.push("t", ids, rows)
        redis_proc.stop()
        for attempt in (
            lambda: ps.pull("t", ids),
            lambda: ps.push("t", ids, rows + 1),
            lambda: ps.describe_table("t"),
            lambda: ps.create_table("t2", dim=2),
        ):
            with pytest.raises(Unavailable) as info:
                attempt()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert redis_proc.address in str(info.value) and "Redis" in str(info.value)
        # the PS itself is alive, and says its store is away
        wait_for_health(ps, "NOT_SERVING", timeout=15)
        assert "dynemb_ps_backend_up 0.0" in proc.metrics_text()
        redis_proc.start()  # same port and directory: the append-only file is loaded again
        wait_for_health(ps, "SERVING", timeout=15)  # by itself
        assert "dynemb_ps_backend_up 1.0" in proc.metrics_text()
        assert ps.describe_table("t").num_rows == 50
        got = ps.pull("t", ids)  # the push during the outage changed nothing
        assert np.array_equal(got.rows, rows) and not got.missing.any()
        assert [t.schema.name for t in ps.list_tables()] == ["t"]
        ps.push("t", [3], np.full((1, 2), 3.0, np.float32))
        assert ps.pull("t", [3]).rows.tolist() == [[3.0, 3.0]]


@pytest.mark.slow
def test_redis_refuses_auth(redis_auth, make_ps):
    proc = make_ps("--backend", redis_auth.url_for(redis_auth.user, "wrong-password"))
    with PSClient(proc.address, retry=RetryPolicy(attempts=1)) as ps:
        with pytest.raises(Unavailable, match="authentication") as info:
            ps.create_table("t", dim=2)
        assert "wrong-password" not in str(info.value)
    good = make_ps("--backend", redis_auth.url, "--namespace", "authok")
    with PSClient(good.address) as ps:
        ps.create_table("t", dim=2)
        ps.push("t", [1], np.ones((1, 2), np.float32))
        assert not ps.pull("t", [1]).missing.any()


def test_import_into_a_table_of_another_schema_fails_cleanly(stored):
    ps, _, table, ids, rows = stored
    clash = TableSchema(table, dim=5, state_width=2)
    drawn = []

    def chunks():  # more than the stream queue holds
        for k in range(50):
            drawn.append(k)
            yield ids + 1000 * (k + 1), np.ones((len(ids), 7), np.float32)

    with pytest.raises(TableExists, match="another schema"):
        ps.import_rows(clash, chunks())
    assert drawn == []  # refused before the source was read
    assert ps.describe_table(table).num_rows == len(ids)


def test_an_import_whose_stream_fails_stops_reading_its_source(make_ps):
    """The PS refuses a chunk mid-import (its table was dropped and re-created with another
    schema under the stream): the client stops drawing from the source instead of reading it
    to the end, and says why."""
    from dynemb.ps_server.errors import PSError

    proc = make_ps()
    schema = TableSchema("midway", dim=4)
    rows = np.ones((1000, 4), np.float32)
    drawn = []
    with PSClient(proc.address) as ps, PSClient(proc.address) as other:

        def chunks():
            for k in range(2000):  # 48 MB if read to the end
                drawn.append(k)
                if k == 3:  # chunks 0-2 were sent; the next ones meet another schema
                    wait_until(lambda: ps.describe_table("midway").num_rows >= 2000, what="chunks 0-1 written")
                    other.drop_table("midway")
                    other.create_table("midway", dim=2)
                yield np.arange(1000, dtype=np.int64) + 1000 * k, rows

        with pytest.raises(PSError, match="midway"):
            ps.import_rows(schema, chunks())
        assert 3 < len(drawn) < 2000, len(drawn)
        assert other.describe_table("midway").schema.dim == 2


class _Aborted(Exception):
    pass


class _Context:
    """A grpc.ServicerContext as far as the service's handlers use it, its deadline set by the test."""

    def __init__(self, remaining: float, active: bool) -> None:
        self.remaining, self.active = remaining, active
        self.code = None

    def time_remaining(self) -> float:
        return self.remaining

    def is_active(self) -> bool:
        return self.active

    def abort(self, code, details):
        self.code = code
        raise _Aborted(details)


@pytest.mark.parametrize("remaining,active", [(0.0, True), (5.0, False)], ids=["deadline-passed", "cancelled"])
@pytest.mark.parametrize("method", ["Push", "PushMany", "Delete"])
def test_the_ps_does_not_apply_a_write_given_up_on_in_its_handler(method, remaining, active):
    """The service's own check, with the deadline under the test's control: past it (grpc's
    thread may not have marked the call ended yet), or cancelled, a write changes nothing."""
    store = EmbeddedStore()
    service = ParameterServerService(store, PSMetrics(), 4 << 20)
    store.create_table(TableSchema("late", dim=2))
    ids = np.arange(5, dtype=np.int64)
    store.push("late", ids, np.zeros((5, 2), np.float32))
    push = ps_pb2.PushRequest(table="late", ids=ids.tobytes(), rows=np.ones((5, 2), np.float32).tobytes())
    requests = {
        "Push": lambda: parse_push_request(push.SerializeToString()),
        "PushMany": lambda: parse_row_entries(ps_pb2.PushManyRequest(pushes=[push]).SerializeToString(), 4, 3, 10),
        "Delete": lambda: ps_pb2.DeleteRequest(table="late", ids=ids.tobytes()),
    }
    handler = getattr(service, method)
    context = _Context(remaining, active)
    with pytest.raises(_Aborted, match="client gave up"):
        handler(requests[method](), context)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    out = np.full((5, 2), -1.0, np.float32)
    assert len(store.pull_into("late", ids, out)) == 0 and not out.any()
    # the same call with time left is applied: the fake context does reach the store
    handler(requests[method](), _Context(5.0, True))
    if method == "Delete":
        assert store.num_rows("late") == 0
    else:
        assert len(store.pull_into("late", ids, out)) == 0 and (out == 1).all()


def test_an_unexpected_error_with_a_huge_message_still_arrives():
    """An INTERNAL error's message is the exception's, which may quote anything: it is cut to
    fit the client's metadata limit."""

    class Broken(EmbeddedStore):
        def schema(self, table):
            raise RuntimeError("x" * 100_000)

    context = _Context(5.0, True)
    with pytest.raises(_Aborted) as info:
        ParameterServerService(Broken(), PSMetrics(), 4 << 20).DescribeTable(
            ps_pb2.DescribeTableRequest(table="t"), context
        )
    assert context.code == grpc.StatusCode.INTERNAL
    assert "DescribeTable failed inside the PS: RuntimeError: xxx" in str(info.value)
    assert str(info.value).endswith("(cut from 100050 characters)") and len(str(info.value)) < 4100


def _request_codes(ps, method: str) -> dict[str, float]:
    """{status code: requests} the PS counted for `method`."""
    return {
        line.split('code="')[1].split('"')[0]: float(line.split()[-1])
        for line in ps.metrics_text().splitlines()
        if line.startswith("dynemb_ps_requests_total") and f'method="{method}"' in line
    }


@pytest.mark.slow
def test_a_push_the_client_gave_up_on_is_not_applied_late(redis_process, make_ps):
    """A push whose handler was still waiting on the store when its deadline passed (Redis
    paused here) is not written once the store answers: the client has sent it again, maybe to
    another replica, and maybe newer rows for the same ids since. (A push still queued for a
    worker at its deadline is dropped by grpc itself, before any handler of ours runs.)"""
    import os
    import signal

    redis_proc = redis_process()
    proc = make_ps("--backend", redis_proc.url, "--namespace", "late")
    ids = np.arange(20, dtype=np.int64)
    with (
        PSClient(proc.address, retry=RetryPolicy(attempts=1), timeout=30) as ps,
        grpc.insecure_channel(proc.address) as channel,
    ):
        ps.create_table("late", dim=2)
        ps.push("late", ids, np.zeros((20, 2), np.float32))
        stale = ps_pb2.PushRequest(table="late", ids=ids.tobytes(), rows=np.ones((20, 2), np.float32).tobytes())
        pause(redis_proc.proc.pid)
        try:
            call = ps_pb2_grpc.ParameterServerStub(channel).Push.future(stale, timeout=2)
            # its handler runs, waiting on the store, before the deadline
            wait_until(
                lambda: "dynemb_ps_inflight_requests 1.0" in proc.metrics_text() or call.done(),
                timeout=10,
                what="the push's handler to start",
            )
            with pytest.raises(grpc.RpcError) as info:
                call.result()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "dynemb_ps_inflight_requests 1.0" in proc.metrics_text()  # still in the handler
        finally:
            os.kill(redis_proc.proc.pid, signal.SIGCONT)
        # the store answers, the handler goes on and refuses to write
        codes = wait_until(
            lambda: (c := _request_codes(proc, "Push")) and sum(c.values()) == 2 and c,
            timeout=15,
            what="the stale push's handler to end",
        )
        assert codes == {"OK": 1.0, "DEADLINE_EXCEEDED": 1.0}
        assert ps.pull("late", ids).rows.tolist() == [[0.0, 0.0]] * 20


def test_undecodable_request_bytes(stored):
    """Bytes that are no valid message: INVALID_ARGUMENT naming the message type, where grpc's
    own decoding step answered INTERNAL "Exception deserializing request!"."""
    ps, _, table, _, _ = stored
    channel = grpc.insecure_channel(ps.addresses[0])
    service = "/dynemb.ps.v1.ParameterServer/"
    for method, data in (("Pull", b"\xff\xff\xff"), ("Push", b"\x0a\x05ab"), ("CreateTable", b"\x0a\x02\x0a\xc3")):
        err = status_of(channel.unary_unary(service + method), data)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert f"not a valid dynemb.ps.v1.{method}" in err.details() and f"{len(data)} bytes" in err.details()
    err = status_of(lambda d: list(channel.unary_stream(service + "Export")(d)), b"\x12")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "ExportRequest" in err.details()
    # a good first chunk of an import, then garbage: the stream is refused at the garbage
    first = ps_pb2.RowChunk(spec=ps_pb2.TableSpec(name=table, dim=4, state_width=2, dtype=ps_pb2.FP32))
    err = status_of(channel.stream_unary(service + "Import"), iter([first.SerializeToString(), b"\x0a"]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid dynemb.ps.v1.RowChunk" in err.details()
    channel.close()


def test_huge_input_is_quoted_short(stored):
    """An error quoting a hostile value in full never arrived: the client's 16 KiB metadata
    limit turned it into RESOURCE_EXHAUSTED "received metadata size exceeds hard limit". Every
    request field an error may quote, over-long, on every method that takes it."""
    _, stub, _, _, _ = stored
    name = "n" * 200_000
    spec = ps_pb2.TableSpec(name=name, dim=1, dtype=ps_pb2.FP32)
    ids = np.arange(2, dtype=np.int64).tobytes()
    push = ps_pb2.PushRequest(table=name, ids=ids, rows=np.zeros(2, np.float32).tobytes())
    pull = ps_pb2.PullRequest(table=name, ids=ids)
    for call, req in (
        (stub.DescribeTable, ps_pb2.DescribeTableRequest(table=name)),
        (stub.DropTable, ps_pb2.DropTableRequest(table=name)),
        (stub.Pull, pull),
        (stub.PullMany, ps_pb2.PullManyRequest(pulls=[pull])),
        (stub.Push, push),
        (stub.PushMany, ps_pb2.PushManyRequest(pushes=[push])),
        (stub.Delete, ps_pb2.DeleteRequest(table=name, ids=ids)),
        (lambda r: list(stub.Export(r)), ps_pb2.ExportRequest(table=name)),
        (lambda r: stub.Import(iter([r])), ps_pb2.RowChunk(spec=spec)),
        (stub.CreateTable, ps_pb2.CreateTableRequest(spec=spec)),
        (stub.CreateTable, ps_pb2.CreateTableRequest(spec=ps_pb2.TableSpec(name=name, dim=1, dtype=42))),
        (stub.AttachSegment, ps_pb2.AttachSegmentRequest(path="/proc/1/fd/" + name, size=1 << 20, token=b"t" * 16)),
    ):
        err = status_of(call, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (type(req).__name__, err.details()[:200])
        assert "(200000 characters)" in err.details() or "(200011 characters)" in err.details()
        assert len(err.details()) < 500


def test_a_pull_of_many_tables_too_big_names_a_few(make_ps):
    """The reply-size error of a PullMany listed every table: thousands of names over the
    metadata limit."""
    proc = make_ps("--max-message-mb", "0.0625")
    names = [f"{k:04d}" + "x" * 120 for k in range(300)]
    with PSClient(proc.address) as ps, grpc.insecure_channel(proc.address) as channel:
        for name in names:
            ps.create_table(name, dim=64)  # 300 x 2 rows of 256 bytes: over 64 KiB
        ids = np.arange(2, dtype=np.int64).tobytes()
        many = ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table=n, ids=ids) for n in names])
        err = status_of(ps_pb2_grpc.ParameterServerStub(channel).PullMany, many)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max message size" in err.details() and "and 297 more" in err.details() and len(err.details()) < 1000


def test_a_refused_first_import_chunk_clears_nothing(stored):
    """replace=True cleared the table before the first chunk's rows were checked."""
    ps, stub, table, ids, rows = stored
    spec = ps.describe_table(table).schema.to_proto()
    for bad in (
        ps_pb2.RowChunk(spec=spec, replace=True, ids=ids[:3].tobytes(), rows=rows[:2].tobytes()),
        ps_pb2.RowChunk(spec=spec, replace=True, ids=ids[:3].tobytes()[:-1], rows=rows[:3].tobytes()),
    ):
        err = status_of(stub.Import, iter([bad]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ps.describe_table(table).num_rows == len(ids)


def test_a_cancelled_import_is_no_server_fault(stored, embedded_ps):
    """A client that cancels an import mid-stream: the PS counts CANCELLED (or OK, where grpc
    hands it the cut as a plain end of stream), never INTERNAL with a traceback."""
    import threading

    _, stub, _, _, _ = stored

    def import_codes():
        text = embedded_ps.metrics_text()
        return {
            line.split('code="')[1].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("dynemb_ps_requests_total") and 'method="Import"' in line
        }

    before, log_start = import_codes(), len(embedded_ps.log())
    spec = ps_pb2.TableSpec(name="cut_import", dim=2, dtype=ps_pb2.FP32)
    for _ in range(20):
        sent, release = threading.Event(), threading.Event()

        def chunks():
            yield ps_pb2.RowChunk(spec=spec, ids=np.arange(3).tobytes(), rows=np.zeros((3, 2), np.float32).tobytes())
            sent.set()
            release.wait(10)

        call = stub.Import.future(chunks())
        assert sent.wait(10)
        call.cancel()
        release.set()
    after = wait_until(
        lambda: (c := import_codes()) and sum(c.values()) - sum(before.values()) >= 20 and c,
        what="the 20 imports counted",
    )
    new = {code: after[code] - before.get(code, 0) for code in after if after[code] != before.get(code, 0)}
    assert sum(new.values()) == 20 and set(new) <= {"CANCELLED", "OK"}, new
    assert "Traceback" not in embedded_ps.log()[log_start:]


@pytest.mark.parametrize("backend", ["embedded", "redis"])
@pytest.mark.parametrize("new_dim,new_dtype", [(4, "bf16"), (3, "fp16")])
def test_import_into_a_table_recreated_under_it(backend, new_dim, new_dtype, make_ps, request):
    """An import stream outlives a drop and re-create of its table with another schema: its
    next chunk is refused, not written into the new table (the embedded store wrote fp16 bits
    into a bf16 table, or failed with INTERNAL on another width)."""
    import threading

    args = ()
    if backend == "redis":
        args = (
            "--backend",
            request.getfixturevalue("redis_url"),
            "--namespace",
            request.getfixturevalue("redis_namespace"),
            "--redis-buckets",
            "8",
        )
    proc = make_ps(*args)
    spec = ps_pb2.TableSpec(name="race", dim=4, dtype=ps_pb2.FP16)
    rows = np.ones((3, 4), np.float16).tobytes()
    go_on = threading.Event()

    def chunks():
        yield ps_pb2.RowChunk(spec=spec, ids=np.arange(3).tobytes(), rows=rows)
        go_on.wait(10)
        yield ps_pb2.RowChunk(ids=np.arange(3, 6).tobytes(), rows=rows)

    with PSClient(proc.address) as ps, grpc.insecure_channel(proc.address) as channel:
        call = ps_pb2_grpc.ParameterServerStub(channel).Import.future(chunks(), timeout=30)
        wait_until(
            lambda: call.done() or any(t.schema.name == "race" and t.num_rows == 3 for t in ps.list_tables()),
            what="the first chunk written",
        )
        assert not call.done(), call.exception()
        ps.drop_table("race")
        ps.create_table("race", dim=new_dim, dtype=new_dtype)
        go_on.set()
        with pytest.raises(grpc.RpcError) as info:
            call.result()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "race" in info.value.details()
        assert ps.describe_table("race").num_rows == 0


@pytest.mark.slow
def test_a_call_past_its_deadline_says_so_by_its_code(make_ps):
    import os
    import signal

    from dynemb.ps_server.errors import DeadlineExceeded

    proc = make_ps()
    with PSClient(proc.address, timeout=30) as ps:
        ps.create_table("slow", dim=2)
        pause(proc.proc.pid)
        try:
            with pytest.raises(DeadlineExceeded) as info:
                ps.pull("slow", [1, 2], timeout=0.5)
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and proc.address in str(info.value)
        assert ps.pull("slow", [1, 2]).missing.all()  # served again: both never pushed


def test_a_table_whose_rows_cannot_travel_is_refused(make_ps):
    proc = make_ps("--max-message-mb", "0.0625", "--max-row-width", "65536")  # 64 KiB messages
    with PSClient(proc.address, max_message_bytes=64 << 10) as ps:
        with pytest.raises(InvalidArgument, match="a row is 80000 bytes, more than fits"):
            ps.create_table("wide", dim=20_000)
        assert [t.schema.name for t in ps.list_tables()] == []
        ps.create_table("fits", dim=10_000)  # 40 KB rows: one per message
        ps.push("fits", [1], np.ones((1, 10_000), np.float32))
        assert ps.pull("fits", [1, 2]).missing.tolist() == [False, True]


def test_a_bad_name_in_a_many_table_call_is_named_wherever_it_stands(stored):
    """Entries were checked in order: an earlier entry's own refusal (its ids, a missing table)
    hid a bad name after it, so what a call was refused for depended on the order of its entries
    (tests/ps_server/test_ps_fuzz.py failed under one random seed for it)."""
    _, stub, table, ids, rows = stored
    bad = "no such\nname"
    for entries in (
        [(table, ids.tobytes()[:5]), (bad, ids.tobytes())],  # ids not a multiple of 8 first
        [("missing_table", ids.tobytes()), (bad, ids.tobytes())],  # a missing table first
    ):
        pulls = ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table=t, ids=i) for t, i in entries])
        pushes = ps_pb2.PushManyRequest(
            pushes=[ps_pb2.PushRequest(table=t, ids=i, rows=rows.tobytes()) for t, i in entries]
        )
        for call, req in ((stub.PullMany, pulls), (stub.PushMany, pushes)):
            err = status_of(call, req)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "table name" in err.details(), err.details()


@pytest.mark.parametrize("method", ["ListTables", "Stats"])
def test_listing_tables_stops_at_the_call_deadline(method):
    """Counting rows table by table stops once nobody waits for the answer: DEADLINE_EXCEEDED."""
    store = EmbeddedStore()
    for i in range(3):
        store.create_table(TableSchema(f"t{i}", dim=2))
    service = ParameterServerService(store, PSMetrics(), 4 << 20)
    request = {"ListTables": ps_pb2.ListTablesRequest(), "Stats": ps_pb2.StatsRequest()}[method]
    context = _Context(0.0, True)
    with pytest.raises(_Aborted, match="listing tables: the call's deadline passed"):
        getattr(service, method)(request, context)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    reply = getattr(service, method)(request, _Context(5.0, True))
    assert [t.spec.name for t in reply.tables] == ["t0", "t1", "t2"]
