"""The PS client's layers (dynemb/ps_server/client/), each against its own contract: the retry policy decides per
status and within the deadline; the transport retries through a PS that is away or hangs, never a refusal, against
real PS processes; sharding cuts batches that merge back in call order; lanes keep a table's calls in call order;
a request whose rows are in shared memory carries none."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from helpers import pause

from dynemb.protos import ps_pb2
from dynemb.ps_server import shm
from dynemb.ps_server.client import PSClient, streaming
from dynemb.ps_server.client.ordering import TableLanes
from dynemb.ps_server.client.retry import RetryPolicy
from dynemb.ps_server.client.sharding import Sharding
from dynemb.ps_server.client.shared_memory import on_loopback, pull_request, push_parts
from dynemb.ps_server.client.transport import Transport
from dynemb.ps_server.errors import DeadlineExceeded, TableNotFound, Unavailable
from dynemb.ps_server.hashing import shard_of
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.wire import MESSAGE_OVERHEAD, encode_push_request, parse_push_request

Code = grpc.StatusCode
LIST = ps_pb2.ListTablesRequest()

# -- retry.py ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [c for c in Code if c != Code.UNAVAILABLE])
def test_only_unavailable_is_retried_without_an_attempt_timeout(code):
    assert RetryPolicy().start(time.monotonic() + 60).next_delay(code) is None
    assert RetryPolicy().start(time.monotonic() + 60).next_delay(Code.UNAVAILABLE) is not None


def test_a_try_past_its_attempt_timeout_is_retried_while_the_call_has_time():
    policy = RetryPolicy(attempt_timeout=0.5)
    assert policy.start(time.monotonic() + 60).next_delay(Code.DEADLINE_EXCEEDED) is not None
    assert policy.start(time.monotonic() - 0.01).next_delay(Code.DEADLINE_EXCEEDED) is None  # the call's own
    assert policy.start(time.monotonic() + 60).next_delay(Code.INVALID_ARGUMENT) is None


def test_each_try_gets_the_attempt_timeout_or_what_is_left_of_the_deadline():
    assert RetryPolicy(attempt_timeout=0.5).start(time.monotonic() + 60).timeout() == 0.5
    assert 0 < RetryPolicy(attempt_timeout=0.5).start(time.monotonic() + 0.2).timeout() <= 0.2
    assert 2.5 < RetryPolicy().start(time.monotonic() + 3).timeout() <= 3


def test_attempts_count_the_first_try():
    tries = RetryPolicy(attempts=3, initial_backoff=0.001).start(time.monotonic() + 60)
    assert [tries.next_delay(Code.UNAVAILABLE) is not None for _ in range(4)] == [True, True, False, False]
    assert tries.retries == 2


def test_without_a_count_tries_go_on_until_the_deadline():
    endless = RetryPolicy(attempts=None, initial_backoff=0.001, max_backoff=0.001).start(time.monotonic() + 60)
    assert all(endless.next_delay(Code.UNAVAILABLE) is not None for _ in range(1000))
    # a wait of at least 0.1 s would end past the deadline: the failure is final now
    late = RetryPolicy(attempts=None, initial_backoff=0.2).start(time.monotonic() + 0.05)
    assert late.next_delay(Code.UNAVAILABLE) is None


def test_backoffs_grow_to_their_cap_with_jitter():
    waits = list(RetryPolicy(attempts=7, initial_backoff=0.1, max_backoff=0.5, multiplier=2).backoffs())
    nominal = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert len(waits) == len(nominal)
    assert all(n / 2 <= w <= n for w, n in zip(waits, nominal)), waits


# -- transport.py, against real PS processes ---------------------------------------------------------------------------


def requests_seen(transport: Transport, shard: int, method: str) -> int:
    stats = transport.call(shard, "Stats", ps_pb2.StatsRequest(), time.monotonic() + 30)
    return sum(m.requests for m in stats.methods if m.method == method)


@pytest.fixture
def transports():
    made: list[Transport] = []

    def make(addresses: list[str], **retry) -> Transport:
        made.append(Transport(addresses, retry=RetryPolicy(**retry)))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_a_refusal_is_not_retried(make_ps, transports):
    transport = transports([make_ps().address], attempts=8, initial_backoff=0.001)
    with pytest.raises(TableNotFound):
        transport.call(0, "DescribeTable", ps_pb2.DescribeTableRequest(table="absent"), time.monotonic() + 30)
    assert requests_seen(transport, 0, "DescribeTable") == 1


def test_a_call_outlasts_a_ps_restart(make_ps, transports, caplog):
    first = make_ps()
    address = first.address
    transport = transports([address], attempts=None, max_backoff=0.2)
    transport.call(0, "ListTables", LIST, time.monotonic() + 30)
    # once seen -9 in a parallel run: not out within 60 s of SIGTERM; its log says where it was
    assert (code := first.stop()) == 0, f"the PS exited {code}; its log:\n{first.log()[-4000:]}"
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.WARNING, "dynemb.ps.client"):
        call = pool.submit(transport.call, 0, "ListTables", LIST, time.monotonic() + 60)
        time.sleep(1.0)
        assert not call.done()
        make_ps("--address", address)  # from this thread: the PS ends with the thread that started it
        assert isinstance(call.result(timeout=60), ps_pb2.ListTablesResponse)
    assert caplog.text.count("UNAVAILABLE; retrying") == 1  # one line per call, not per try


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_default_client_outlasts_a_restart_slower_than_its_backoffs(
    make_ps, redis_url, redis_namespace, shared_memory
):
    """PSClient(timeout=T) with its default retry policy waits for a PS away longer than its
    backoffs add up to (~5 s): it gave up after 3-4 s when it counted tries (issue 44)."""
    backend = ("--backend", redis_url, "--namespace", redis_namespace)
    first = make_ps(*backend)
    address = first.address
    ids = np.arange(100, dtype=np.int64)
    with PSClient(address, timeout=40, shared_memory=shared_memory) as client:
        client.create_table("t", dim=4)
        client.push("t", ids, np.ones((100, 4), dtype=np.float32))
        assert first.stop() == 0, first.log()[-4000:]
        with ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            call = pool.submit(client.pull, "t", ids)
            time.sleep(9.0)
            assert not call.done(), call.exception()
            make_ps(*backend, "--address", address)
            got = call.result(timeout=60)
    assert not got.missing.any() and (got.rows == 1).all()
    assert time.monotonic() - start > 9.0


def test_export_and_import_streams_outlast_a_ps_restart(make_ps, transports, redis_url, redis_namespace, caplog):
    """An Export or Import stream that meets a PS away (UNAVAILABLE) before it could give or take much is opened
    again until its retry time, as unary calls are tried again: the export gives every row once, the import writes
    every row (the chunks the failed stream took are sent again). PSClient's own calls before a stream (its
    DescribeTable, CreateTable) would wait for the PS first, so the streams are started through the transport."""
    backend = ("--backend", redis_url, "--namespace", redis_namespace)
    first = make_ps(*backend)
    address = first.address
    transport = transports([address], max_backoff=0.2)
    schema = TableSchema("t", dim=4)
    ids = np.arange(3000, dtype=np.int64)
    rows = np.random.default_rng(5).random((3000, 4), dtype=np.float32)
    with PSClient(address, timeout=30) as client:
        client.create_table("t", dim=4)
        client.push("t", ids, rows)
    sharding = Sharding(1, chunk_bytes=64 << 10)
    ps = first
    for what in ("export", "import"):
        assert (code := ps.stop()) == 0, f"the PS exited {code}; its log:\n{ps.log()[-4000:]}"
        with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.WARNING, "dynemb.ps.client"):
            if what == "export":
                call = pool.submit(lambda: list(streaming.export_rows(transport, schema, 500, None, 60)))
            else:  # 3 chunks of 1000 rows: fewer than the stream keeps to send again
                source = ((ids[k : k + 1000], rows[k : k + 1000] + 1) for k in range(0, 3000, 1000))
                call = pool.submit(streaming.import_rows, transport, sharding, schema, source, True, None, 60)
            time.sleep(1.5)
            assert not call.done(), call.exception()
            ps = make_ps(*backend, "--address", address)  # from this thread: the PS ends with it
            got = call.result(timeout=60)
        assert f"{what.title()} stream" in caplog.text and "UNAVAILABLE" in caplog.text
        caplog.clear()
        if what == "export":
            got_ids = np.concatenate([i for i, _ in got])
            assert np.array_equal(np.sort(got_ids), ids)  # each row once
            assert np.array_equal(np.concatenate([r for _, r in got])[np.argsort(got_ids)], rows)
        else:
            assert got == 3000
            with PSClient(address, timeout=30) as client:
                assert np.array_equal(client.pull("t", ids).rows, rows + 1)


def test_streams_that_failed_part_way_are_not_opened_again_and_say_so(make_ps, transports):
    """A stream cut off after it gave rows (export) or took more chunks than the client keeps (import) is not
    opened again: the export would give its rows twice, the import lacks the chunks to send again. The error
    says what to do."""
    proc = make_ps()
    transport = transports([proc.address], max_backoff=0.2)
    schema = TableSchema("t", dim=4)
    with PSClient(proc.address, timeout=30) as client:
        client.create_table("t", dim=4)
        client.push("t", np.arange(5000, dtype=np.int64), np.ones((5000, 4), np.float32))
    exported = streaming.export_rows(transport, schema, 100, None, 60)
    next(exported)  # rows given: the stream is no longer to be repeated
    proc.stop(signal.SIGKILL)
    with pytest.raises(Unavailable, match="is not opened again .*call it again"):
        list(exported)

    proc = make_ps()
    transport = transports([proc.address], max_backoff=0.2)
    with PSClient(proc.address, timeout=30) as client:
        client.create_table("t", dim=4)
    drawn = []

    def source():
        for k in range(1000):
            drawn.append(k)
            if k == 20:  # 20 chunks taken (at most 4 queued): more than are kept to send again
                proc.stop(signal.SIGKILL)
            yield np.arange(100, dtype=np.int64) + 100 * k, np.ones((100, 4), np.float32)

    with pytest.raises(Unavailable, match=r"had taken \d+ rows, more than the client keeps.*run it again"):
        streaming.import_rows(transport, Sharding(1, chunk_bytes=64 << 10), schema, source(), False, None, 60)
    assert len(drawn) < 100  # reading stopped soon after the stream failed


def test_a_ps_that_stays_away_fails_the_call_by_its_deadline(transports):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    transport = transports([address], attempts=None, initial_backoff=0.05, max_backoff=0.1)
    start = time.monotonic()
    # the one line says what the call did: its tries, their time, what ended them
    with pytest.raises(Unavailable, match=rf"{address}.*; \d+ tries over \d\.\d s, until the call's deadline"):
        transport.call(0, "ListTables", LIST, start + 1.0)
    assert 0.5 < time.monotonic() - start < 3.0  # tried until about the deadline, not beyond
    few = transports([address], attempts=2, initial_backoff=0.05)
    start = time.monotonic()
    with pytest.raises(Unavailable, match=r"2 tries over \d\.\d s, until the retry policy's limit of 2"):
        few.call(0, "ListTables", LIST, start + 30)
    assert time.monotonic() - start < 2.0


def test_a_wait_that_overruns_the_deadline_reports_the_last_try(transports, monkeypatch):
    """On a loaded machine the wait between tries can end past the deadline: the call then
    fails with the last try's error (the PS unavailable, named), not a bare deadline."""
    from dynemb.ps_server.client import transport as transport_module

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    transport = transports([address], attempts=None, initial_backoff=0.05, max_backoff=0.1)
    real_sleep = time.sleep
    monkeypatch.setattr(transport_module.time, "sleep", lambda seconds: real_sleep(seconds + 0.5))
    with pytest.raises(Unavailable, match=address):
        transport.call(0, "ListTables", LIST, time.monotonic() + 0.3)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()


def test_a_call_that_ends_in_a_timeout_still_says_why_it_failed(transports):
    """A PS that said why (UNAVAILABLE: its Redis away) and then stopped answering in time: the
    one line names both, not only the deadline."""
    transport = transports(["127.0.0.1:1"], attempts=3, initial_backoff=0.01)
    replies = iter(
        [
            _Failed(grpc.StatusCode.UNAVAILABLE, "Redis at 10.0.0.5:6379 is unavailable: TimeoutError"),
            _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
            _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        ]
    )

    def stub_call(request, timeout=None, metadata=None):
        raise next(replies)

    transport.stubs[0] = type("Stub", (), {"ListTables": staticmethod(stub_call)})()
    retry = RetryPolicy(attempts=3, initial_backoff=0.01, attempt_timeout=0.5)
    transport.retry = retry
    with pytest.raises(DeadlineExceeded, match=r"Deadline Exceeded.*the try before: .*Redis at 10\.0\.0\.5:6379"):
        transport.call(0, "ListTables", LIST, time.monotonic() + 10)


def test_a_hung_try_is_abandoned_and_sent_again(make_ps, transports, caplog):
    proc = make_ps()
    transport = transports([proc.address], attempts=None, attempt_timeout=0.3, max_backoff=0.1)
    transport.call(0, "ListTables", LIST, time.monotonic() + 30)
    pause(proc.proc.pid)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, "dynemb.ps.client"), pytest.raises(DeadlineExceeded):
            transport.call(0, "ListTables", LIST, start + 1.5)
        assert time.monotonic() - start < 4.0
        assert "DEADLINE_EXCEEDED; retrying" in caplog.text
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    assert isinstance(transport.call(0, "ListTables", LIST, time.monotonic() + 30), ps_pb2.ListTablesResponse)


def test_fanout_answers_in_the_order_asked_and_errors_name_their_ps(make_ps, transports):
    procs = [make_ps(), make_ps()]
    transport = transports([p.address for p in procs])
    deadline = time.monotonic() + 30
    transport.call(1, "CreateTable", ps_pb2.CreateTableRequest(spec=TableSchema("t", 4).to_proto()), deadline)
    replies = transport.fanout("ListTables", [(1, LIST), (0, LIST), (1, LIST)], deadline)
    assert [len(r.tables) for r in replies] == [1, 0, 1]
    assert [len(r.tables) for r in transport.to_every_shard("ListTables", LIST, deadline)] == [0, 1]
    describe = ps_pb2.DescribeTableRequest(table="t")
    with pytest.raises(TableNotFound, match=procs[0].address):
        transport.fanout("DescribeTable", [(1, describe), (0, describe)], deadline)


# -- sharding.py ------------------------------------------------------------------------------------------------------


def random_ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)


def test_pieces_cover_every_id_once_on_its_owner_and_under_the_limit():
    per_msg = 100
    sharding = Sharding(3, chunk_bytes=MESSAGE_OVERHEAD + per_msg * 16)
    ids = random_ids(1000)
    owners = sharding.owners(ids)
    seen = np.zeros(len(ids), dtype=int)
    sizes: dict[int, list[int]] = {}
    for shard, dest, got in sharding.split_ids(ids, 16):
        assert np.array_equal(ids[dest], got) and (owners[dest] == shard).all()
        seen[dest] += 1
        sizes.setdefault(shard, []).append(len(got))
    assert (seen == 1).all()
    for shard, parts in sizes.items():  # equal parts, each under the limit
        assert max(parts) <= per_msg and max(parts) - min(parts) <= 1
        assert sum(parts) == (owners == shard).sum()


def test_replies_merge_back_in_call_order():
    ids = random_ids(5000, seed=1)
    ids[100:200] = ids[:100]  # repeated ids are pulled at each position
    merged = np.zeros_like(ids)
    for _, dest, got in Sharding(4, chunk_bytes=MESSAGE_OVERHEAD + (64 << 10)).split_ids(ids, 9):
        merged[dest] = got  # as a pull writes each piece's reply rows
    assert np.array_equal(merged, ids)
    assert Sharding(2, 1 << 20).split_ids(ids[:0], 9) == []


def test_an_id_belongs_to_the_same_shard_in_any_batch():
    ids = random_ids(2000, seed=2)
    sharding = Sharding(5, 1 << 20)
    alone = np.array([sharding.owners(ids[k : k + 1])[0] for k in range(0, 2000, 97)])
    assert np.array_equal(sharding.owners(ids)[::97], alone)
    assert np.array_equal(sharding.owners(ids), shard_of(ids, 5))
    assert np.bincount(sharding.owners(ids), minlength=5).min() > 300  # spread


def test_a_small_batch_for_one_ps_goes_as_it_is():
    order, pieces = Sharding(1, 1 << 20).split(random_ids(10), 16)
    assert order is None and pieces == [(0, slice(0, 10))]


def test_a_push_cut_in_pieces_keeps_each_ids_last_row():
    ids = np.array([5, 7, 5, 9, 7, 5] * 10, dtype=np.int64)
    rows = np.arange(len(ids))[:, None]
    last = {int(i): k for k, i in enumerate(ids)}
    kept: dict[int, int] = {}
    pieces = Sharding(2, chunk_bytes=MESSAGE_OVERHEAD + 2 * 16).split_rows(ids, rows, 16)
    assert len(pieces) > 1
    for _, got_ids, got_rows in pieces:
        for i, row in zip(got_ids.tolist(), got_rows[:, 0].tolist()):
            assert i not in kept
            kept[i] = row
    assert kept == last
    # in one piece, every row goes: the PS keeps the last itself
    ((_, got_ids, got_rows),) = Sharding(1, 1 << 20).split_rows(ids, rows, 16)
    assert np.array_equal(got_ids, ids) and np.array_equal(got_rows, rows)


def test_pack_keeps_each_shards_order_under_the_limit():
    sharding = Sharding(2, chunk_bytes=MESSAGE_OVERHEAD + 100)
    pieces = [(0, 60, "a"), (1, 60, "b"), (0, 30, "c"), (0, 30, "d"), (1, 40, "e")]
    assert sharding.pack(pieces) == [(0, ["a", "c"]), (1, ["b", "e"]), (0, ["d"])]


def test_stream_pieces_keep_the_chunks_order():
    ids = random_ids(1000, seed=3)
    sharding = Sharding(3, chunk_bytes=MESSAGE_OVERHEAD + 50 * 16)
    pieces = list(sharding.stream_pieces(ids, 16))
    owners = sharding.owners(ids)
    for shard in range(3):
        positions = np.concatenate([pos for s, pos in pieces if s == shard])
        assert np.array_equal(positions, np.flatnonzero(owners == shard))  # ascending: the chunk's order
    assert max(len(pos) for _, pos in pieces) <= 50


# -- ordering.py ------------------------------------------------------------------------------------------------------


def on_another_lane(lanes: int, *tables: str) -> str:
    """A table name whose lane (TableLanes: CRC-32 of the name) none of these tables has."""
    taken = {zlib.crc32(t.encode()) % lanes for t in tables}
    return next(t for t in map(str, range(1000)) if zlib.crc32(t.encode()) % lanes not in taken)


def test_a_tables_calls_run_in_call_order():
    lanes = TableLanes(2)
    done: list[int] = []

    def step(k: int) -> None:
        time.sleep(0.01 * (5 - k))  # the first call is the slowest
        done.append(k)

    futures = [lanes.submit("t", step, k) for k in range(5)]
    lanes.close()
    assert done == list(range(5)) and all(f.done() for f in futures)


def test_different_tables_run_side_by_side():
    lanes = TableLanes(8)
    a = "a"
    b = on_another_lane(8, a)
    met = threading.Event()
    waiting = lanes.submit(a, met.wait, 10)
    lanes.submit(b, met.set)
    assert waiting.result(timeout=20) is True  # set by b's call while a's was running
    lanes.close()


def test_a_call_on_several_tables_runs_between_their_calls():
    lanes = TableLanes(4)
    order: list[str] = []
    gate = threading.Event()
    lanes.submit("a", lambda: gate.wait(10) and order.append("a1"))
    lanes.submit("b", order.append, "b1")
    lanes.submit_many(["a", "b"], order.append, "many")
    lanes.submit("a", order.append, "a2")
    lanes.submit("b", order.append, "b2")
    lanes.submit(on_another_lane(4, "a", "b"), order.append, "c")  # not involved: need not wait
    time.sleep(0.2)
    assert "many" not in order and "c" in order
    gate.set()
    lanes.close()
    at = {name: k for k, name in enumerate(order)}
    assert at["a1"] < at["many"] and at["b1"] < at["many"] and at["many"] < at["a2"] and at["many"] < at["b2"]


# -- shared_memory.py -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, local",
    [
        ("127.0.0.1:5", True),
        ("localhost:5", True),
        ("[::1]:5", True),
        ("127.0.0.1:5|localhost:6", True),
        ("127.0.0.1:5|10.0.0.1:6", False),
        ("ps-0:50051", False),
        ("unix:/tmp/ps.sock", True),
    ],
)
def test_shared_memory_by_itself_only_with_a_ps_on_loopback(address, local):
    assert on_loopback(address) == local


def test_requests_whose_rows_are_in_a_segment_carry_none():
    seg = shm.Segment(1 << 20)
    seg.segment = 42
    try:
        ids = np.arange(10, dtype=np.int64)
        rows = np.random.default_rng(0).random((10, 4), dtype=np.float32)
        place = (seg, shm.ROWS_START + 64)
        call = parse_push_request(b"".join(push_parts("t", ids, rows, place)))
        assert not len(call.rows) and call.rows_from == (42, shm.ROWS_START + 64, rows.nbytes)
        assert np.array_equal(seg.rows(place[1], 10, 4, rows.dtype), rows)
        assert b"".join(push_parts("t", ids, rows, None)) == encode_push_request("t", ids, rows)
        pull = pull_request("t", ids, TableSchema("t", 4), place)
        assert (pull.rows_to.segment, pull.rows_to.offset, pull.rows_to.size) == (42, place[1], rows.nbytes)
        assert not pull_request("t", ids, TableSchema("t", 4), None).HasField("rows_to")
    finally:
        seg.close_fd()
