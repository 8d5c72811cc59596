"""Bad input through a real PS: the right status, a message that names the problem, the
server still serving, and nothing stored changed."""

from __future__ import annotations

import time
import urllib.request

import grpc
import numpy as np
import pytest

from protos import ps_pb2, ps_pb2_grpc
from ps_server.client import PSClient, RetryPolicy
from ps_server.errors import InvalidArgument, TableExists, TableNotFound, Unavailable


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
    for spec, words in (
        (ps_pb2.TableSpec(name="x", dim=0, dtype=ps_pb2.FP32), "dim"),
        (ps_pb2.TableSpec(name="has space", dim=4, dtype=ps_pb2.FP32), "table name"),
        (ps_pb2.TableSpec(name="x", dim=4), "dtype"),
        (ps_pb2.TableSpec(name="x", dim=4, dtype=ps_pb2.FP32,
                          initializer=ps_pb2.Initializer(kind=ps_pb2.Initializer.UNIFORM, a=1, b=0)), "b > a"),
    ):
        err = status_of(stub.CreateTable, ps_pb2.CreateTableRequest(spec=spec))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


def test_oversized_messages(make_ps):
    proc = make_ps("--max-message-mb", "1")
    with PSClient(proc.address) as ps:
        ps.create_table("big", dim=64)
        ids = np.arange(6000, dtype=np.int64)
        rows = np.ones((len(ids), 64), np.float32)  # 1.5 MiB
        channel = grpc.insecure_channel(proc.address, options=[("grpc.max_send_message_length", 64 << 20),
                                                               ("grpc.max_receive_message_length", 64 << 20)])
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


def wait_for_health(ps: PSClient, want: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := ps.health()) != [want]:
        assert time.monotonic() < deadline, f"health stayed {got}, expected {want}"
        time.sleep(0.1)


def metrics_text(proc) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()


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
        for attempt in (lambda: ps.pull("t", ids), lambda: ps.push("t", ids, rows + 1),
                        lambda: ps.describe_table("t"), lambda: ps.create_table("t2", dim=2)):
            with pytest.raises(Unavailable) as info:
                attempt()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert redis_proc.address in str(info.value) and "Redis" in str(info.value)
        # the PS itself is alive, and says its store is away
        wait_for_health(ps, "NOT_SERVING")
        assert "dynemb_ps_backend_up 0.0" in metrics_text(proc)
        redis_proc.start()  # same port and directory: the append-only file is loaded again
        wait_for_health(ps, "SERVING")  # by itself
        assert "dynemb_ps_backend_up 1.0" in metrics_text(proc)
        assert ps.describe_table("t").num_rows == 50
        got = ps.pull("t", ids)  # the push during the outage changed nothing
        assert np.array_equal(got.rows, rows) and not got.missing.any()
        assert [t.schema.name for t in ps.list_tables()] == ["t"]
        ps.push("t", [3], np.full((1, 2), 3.0, np.float32))
        assert ps.pull("t", [3]).rows.tolist() == [[3.0, 3.0]]


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
    from ps_server.schema import TableSchema

    clash = TableSchema(table, dim=5, state_width=2)
    drawn = []

    def chunks():  # more than the stream queue holds
        for k in range(50):
            drawn.append(k)
            yield ids + 1000 * (k + 1), np.ones((len(ids), 7), np.float32)

    with pytest.raises(TableExists, match="another schema"):
        ps.import_rows(clash, chunks())
    assert len(drawn) < 50  # the failed stream stopped the import; the rest was never read
    assert ps.describe_table(table).num_rows == len(ids)



def test_a_push_the_client_gave_up_on_is_not_applied_late(make_ps):
    """A push that waited in the PS past its deadline (every worker busy, or the PS paused) is
    not written when its turn comes: the client has sent it again, maybe to another replica,
    and maybe newer rows for the same ids since."""
    import queue
    import threading

    proc = make_ps("--workers", "1")
    ids = np.arange(20, dtype=np.int64)
    with PSClient(proc.address, retry=RetryPolicy(attempts=1), timeout=30) as ps:
        ps.create_table("late", dim=2)
        ps.push("late", ids, np.zeros((20, 2), np.float32))
        channel = grpc.insecure_channel(proc.address)
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        # an Import stream held open keeps the PS's only worker busy
        held: queue.Queue = queue.Queue()

        def chunks():
            yield ps_pb2.RowChunk(spec=ps_pb2.TableSpec(name="other", dim=2, dtype=ps_pb2.FP32))
            held.get()

        importing = threading.Thread(target=lambda: stub.Import(chunks(), timeout=30), daemon=True)
        importing.start()
        time.sleep(0.5)
        stale = ps_pb2.PushRequest(table="late", ids=ids.tobytes(), rows=np.ones((20, 2), np.float32).tobytes())
        with pytest.raises(grpc.RpcError) as info:
            stub.Push(stale, timeout=0.5)  # waits for the worker past its deadline
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        held.put(None)
        importing.join(30)
        time.sleep(0.5)  # the stale push has had its turn by now
        assert ps.pull("late", ids).rows.tolist() == [[0.0, 0.0]] * 20
        channel.close()


def test_bytes_that_parse_as_no_message_get_invalid_argument(make_ps):
    """gRPC would answer INTERNAL ("Exception deserializing request!"); the PS says what is wrong."""
    proc = make_ps()
    channel = grpc.insecure_channel(proc.address)
    ident = lambda b: b  # noqa: E731
    garbage = b"\x12\xff\xff\xff\xff\x0fxy"  # field 2, a length far past the end
    pull = channel.unary_unary("/dynemb.ps.v1.ParameterServer/Pull", request_serializer=ident, response_deserializer=ident)
    with pytest.raises(grpc.RpcError) as info:
        pull(garbage, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid PullRequest" in info.value.details()
    imp = channel.stream_unary("/dynemb.ps.v1.ParameterServer/Import", request_serializer=ident, response_deserializer=ident)
    first = ps_pb2.RowChunk(spec=ps_pb2.TableSpec(name="imp", dim=2, dtype=ps_pb2.FP32)).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        imp(iter([first, garbage]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid RowChunk" in info.value.details()
    with PSClient(proc.address) as ps:
        assert ps.health() == ["SERVING"]
    channel.close()
