"""Same-host row transfer (dynemb/ps_server/shm.py) against real PS processes: the rows of pulls and
pushes go through a memfd both map; the PS refuses memory it must not map; segments that
expire or outlive a PS are replaced without the caller noticing; a failed call never
hands its segment to a later one."""

from __future__ import annotations

import fcntl
import os
import time

import grpc
import numpy as np
import pytest
from helpers import noted_retry, wait_until

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server import shm
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument, TableNotFound
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.wire import encode_push_many_request, push_request_parts

SERVICE = "/dynemb.ps.v1.ParameterServer/"


def stub(proc) -> ps_pb2_grpc.ParameterServerStub:
    return ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(proc.address))


def metric(proc, name: str) -> float:
    for line in proc.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def attaches(ps: PSClient) -> int:
    return sum(m.requests for m in ps.stats()[0].methods if m.method == "AttachSegment")


def expect(code: grpc.StatusCode, words: str, fn, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value.details()
    assert words.lower() in info.value.details().lower(), info.value.details()


@pytest.fixture
def ps_proc(make_ps):
    return make_ps()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_rows_through_shared_memory_equal_rows_as_bytes(ps_proc, dtype):
    rng = np.random.default_rng(3)
    with PSClient(ps_proc.address) as fast, PSClient(ps_proc.address, shared_memory=False) as plain:
        assert fast._pools[0] is not None and plain._pools[0] is None  # loopback: on by itself
        fast.create_table("a", dim=5, state_width=2, dtype=dtype)
        fast.create_table("b", dim=3, dtype=dtype)
        n = 5000
        ids = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
        ids[10:20] = ids[:10]  # repeated ids: the last row wins
        # any bits: the PS moves rows, it never reads them as numbers
        rows = {
            t: rng.integers(0, 256, (n, w * fast.schema(t).np_dtype.itemsize), dtype=np.uint8).view(
                fast.schema(t).np_dtype
            )
            for t, w in (("a", 7), ("b", 3))
        }
        assert fast.push("a", ids, rows["a"]) == n
        fast.push_many({"b": (ids, rows["b"])})
        for t in ("a", "b"):
            want = plain.pull(t, ids)
            got = fast.pull(t, ids)
            assert got.rows.tobytes() == want.rows.tobytes() and not got.missing.any()
            assert got.rows[:10].tobytes() == rows[t][10:20].tobytes()
        unknown = np.array([1, 2, ids[0], 3], dtype=np.int64)
        many = fast.pull_many({"a": unknown, "b": ids[30:37]})
        assert many["a"].missing.tolist() == [True, True, False, True]
        assert many["a"].rows.tobytes() == plain.pull("a", unknown).rows.tobytes()
        assert many["b"].rows.tobytes() == rows["b"][30:37].tobytes()
        assert fast.pull("a", []).rows.shape == (0, 7)
        assert attaches(fast) >= 1
    assert metric(ps_proc, "dynemb_ps_shm_segments") == 0  # both clients closed: every segment detached


def test_rows_never_travel_in_the_messages(ps_proc):
    """The PS's reply to a pull through a segment has no rows: intercept the raw reply."""
    with PSClient(ps_proc.address) as ps:
        ps.create_table("t", dim=64)
        ids = np.arange(1000, dtype=np.int64)
        rows = np.random.default_rng(0).random((1000, 64), dtype=np.float32)
        ps.push("t", ids, rows)
        sizes = []
        pull = ps._stubs[0].Pull

        class Spy:
            def __call__(self, *a, **k):
                reply = pull(*a, **k)
                sizes.append(len(reply))
                return reply

            def future(self, *a, **k):
                return pull.future(*a, **k)

        ps._stubs[0].Pull = Spy()
        assert np.array_equal(ps.pull("t", ids).rows, rows)
        assert sizes and max(sizes) < 1000, sizes  # 256 kB of rows, none in the reply
    assert metric(ps_proc, "dynemb_ps_shm_bytes") == 0


def test_a_ps_that_takes_no_segments_gets_rows_as_bytes(make_ps):
    proc = make_ps("--shm-max-mb", "0")
    with PSClient(proc.address) as ps:
        ps.create_table("t", dim=4)
        ids = np.arange(100, dtype=np.int64)
        rows = np.ones((100, 4), np.float32)
        ps.push("t", ids, rows)
        assert np.array_equal(ps.pull("t", ids).rows, rows)
        assert np.array_equal(ps.pull_many({"t": ids})["t"].rows, rows)
        assert attaches(ps) == 1  # asked once, refused, not asked again
        assert metric(proc, "dynemb_ps_shm_segments") == 0


@pytest.mark.slow
def test_an_expired_segment_is_replaced_within_the_call(make_ps):
    proc = make_ps("--shm-idle-seconds", "0.3")
    with PSClient(proc.address) as a, PSClient(proc.address) as b:
        a.create_table("t", dim=8)
        ids = np.arange(500, dtype=np.int64)
        rows = np.random.default_rng(1).random((500, 8), dtype=np.float32)
        a.push("t", ids, rows)
        time.sleep(0.6)  # a's segment idle past --shm-idle-seconds: time itself is the condition
        b.pull("t", ids)  # b's attach sweeps a's idle segment away
        assert metric(proc, "dynemb_ps_shm_segments") == 1
        before = attaches(a)
        assert np.array_equal(a.pull("t", ids).rows, rows)  # refused, re-attached, pulled
        a.push("t", ids, rows + 1)
        assert np.array_equal(b.pull("t", ids).rows, rows + 1)
        assert attaches(a) == before + 1


@pytest.mark.slow
def test_a_restarted_ps_gets_new_segments(make_ps, tmp_path):
    backend = f"embedded://{tmp_path}/tables"
    first = make_ps("--backend", backend)
    port = first.address.rsplit(":", 1)[1]
    with PSClient(first.address, timeout=30) as ps:
        ps.create_table("t", dim=4)
        ids = np.arange(300, dtype=np.int64)
        rows = np.random.default_rng(2).random((300, 4), dtype=np.float32)
        ps.push("t", ids, rows)
        assert first.stop() == 0
        make_ps("--backend", backend, "--address", f"127.0.0.1:{port}")
        # the old segment ids mean nothing to the new PS: the client attaches again, unseen
        assert np.array_equal(ps.pull("t", ids).rows, rows)
        ps.push("t", ids, rows * 2)
        assert np.array_equal(ps.pull_many({"t": ids})["t"].rows, rows * 2)


@pytest.mark.slow
def test_a_ps_that_is_away_gets_rows_once_back(make_ps, tmp_path):
    """Calls made while the PS is down wait for it (retries within the deadline), whether they
    hold a segment from before (then refused by the new PS: attached anew) or must attach one
    (then sent as bytes this time)."""
    backend = f"embedded://{tmp_path}/tables"
    first = make_ps("--backend", backend)
    address = first.address
    ids = np.arange(200, dtype=np.int64)
    rows = np.random.default_rng(5).random((200, 4), dtype=np.float32)
    # as a trainer's client: retry for the whole deadline
    (patient, old_retrying), (fresh_patient, fresh_retrying) = noted_retry(attempts=None), noted_retry(attempts=None)
    with PSClient(address, timeout=60, retry=patient) as old:
        old.create_table("t", dim=4)
        old.push("t", ids, rows)
        assert first.stop() == 0
        fresh = PSClient(address, timeout=60, retry=fresh_patient)  # its first call must attach while the PS is away
        pulls = [fresh.pull_async("t", ids), old.pull_async("t", ids)]
        assert old_retrying.wait(30) and fresh_retrying.wait(30)  # both tried while the PS was away
        # from this thread: the PS ends with the thread that started it (PR_SET_PDEATHSIG)
        make_ps("--backend", backend, "--address", address)
        for f in pulls:
            assert np.array_equal(f.result(timeout=60).rows, rows)
        fresh.push("t", ids, rows + 1)  # and from now on, through a segment of its own
        assert np.array_equal(old.pull("t", ids).rows, rows + 1)
        assert fresh._pools[0]._free
        fresh.close()


def test_a_failed_call_drops_its_segment(ps_proc):
    with PSClient(ps_proc.address) as ps:
        ps.create_table("t", dim=4)
        ps.pull("t", np.arange(10))
        pool = ps._pools[0]
        assert len(pool._free) == 1 and metric(ps_proc, "dynemb_ps_shm_segments") == 1
        kept = pool._free[0]
        ps.create_table("gone", dim=4)
        ps.drop_table("gone")
        ps._remember(TableSchema("gone", 4))  # a stale cached schema: the pull reaches the PS
        with pytest.raises(TableNotFound):
            ps.pull("gone", np.arange(10))
        # the segment that call held is detached and not reused: a PS still busy with an
        # abandoned try could write into it
        assert kept not in pool._free and not pool._free
        wait_until(lambda: metric(ps_proc, "dynemb_ps_shm_segments") == 0, what="the segment detached")
        ps.pull("t", np.arange(10))  # a new one
        assert len(pool._free) == 1 and pool._free[0] is not kept


def test_a_stale_schema_is_refused_and_forgotten(ps_proc):
    with PSClient(ps_proc.address) as ps, PSClient(ps_proc.address) as other:
        ps.create_table("t", dim=4)
        ps.pull("t", np.arange(5))
        other.drop_table("t")
        other.create_table("t", dim=6)  # wider rows than ps has cached
        with pytest.raises(InvalidArgument, match="another schema"):
            ps.pull("t", np.arange(5))
        assert ps.pull("t", np.arange(5)).rows.shape == (5, 6)  # described again
        with pytest.raises(InvalidArgument):
            ps.push("t", np.arange(5), np.ones((5, 4), np.float32))  # checked against the fresh schema


def test_many_calls_in_flight_keep_their_rows_apart(ps_proc):
    rng = np.random.default_rng(4)
    with PSClient(ps_proc.address, lanes=4) as ps:
        tables = [f"t{k}" for k in range(8)]
        for t in tables:
            ps.create_table(t, dim=16)
        want = {t: rng.random((2000, 16), dtype=np.float32) for t in tables}
        ids = np.arange(2000, dtype=np.int64)
        for rnd in range(3):
            pushes = [ps.push_async(t, ids, want[t] + rnd) for t in tables]
            pulls = [ps.pull_async(t, ids) for t in tables]
            many = ps.pull_many_async({t: ids[::-1] for t in tables})
            for t, f in zip(tables, pulls):
                assert np.array_equal(f.result().rows, want[t] + rnd)  # after its table's push
            for f in pushes:
                assert f.result() == 2000
            for t, got in many.result().items():
                assert np.array_equal(got.rows, (want[t] + rnd)[::-1])
        assert len(ps._pools[0]._free) <= ps._pools[0].keep == 5  # lanes + 1


# -- what the PS refuses to map ------------------------------------------------------


def _memfd(size: int, seal: bool = True) -> tuple[int, bytes]:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    token = os.urandom(shm.TOKEN_BYTES)
    os.pwrite(fd, token, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd, token


def test_attach_refuses_what_it_must_not_map(make_ps, tmp_path):
    proc = make_ps("--shm-max-mb", "2")
    s = stub(proc)
    me = os.getpid()
    attach = s.AttachSegment
    req = ps_pb2.AttachSegmentRequest
    fd, token = _memfd(1 << 20)
    code, mib, mine = grpc.StatusCode, 1 << 20, f"/proc/{me}/fd"
    expect(code.INVALID_ARGUMENT, "/proc/<pid>/fd/<fd>", attach, req(path="/etc/passwd", size=mib, token=token))
    expect(code.INVALID_ARGUMENT, "/proc/<pid>/fd/<fd>", attach, req(path=f"/proc/self/fd/{fd}", size=mib, token=token))
    expect(code.INVALID_ARGUMENT, "token", attach, req(path=f"{mine}/{fd}", size=mib, token=b"x"))
    expect(code.RESOURCE_EXHAUSTED, "--shm-max-mb", attach, req(path=f"{mine}/{fd}", size=3 * mib, token=token))
    expect(code.FAILED_PRECONDITION, "size", attach, req(path=f"{mine}/{fd}", size=mib // 2, token=token))
    expect(
        code.FAILED_PRECONDITION, "token", attach, req(path=f"{mine}/{fd}", size=mib, token=os.urandom(shm.TOKEN_BYTES))
    )
    loose, loose_token = _memfd(mib, seal=False)  # could shrink under the PS: SIGBUS
    expect(code.FAILED_PRECONDITION, "sealed", attach, req(path=f"{mine}/{loose}", size=mib, token=loose_token))
    plain = os.open(tmp_path / "rows", os.O_RDWR | os.O_CREAT)
    os.ftruncate(plain, mib)
    os.pwrite(plain, token, 0)
    expect(code.FAILED_PRECONDITION, "not a memfd", attach, req(path=f"{mine}/{plain}", size=mib, token=token))
    # sealed against writes: mmap refused with EPERM, which came back as INTERNAL with a traceback
    sealed, sealed_token = _memfd(mib)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    expect(
        code.FAILED_PRECONDITION,
        "sealed against writes",
        attach,
        req(path=f"{mine}/{sealed}", size=mib, token=sealed_token),
    )
    future, future_token = _memfd(mib)
    fcntl.fcntl(future, fcntl.F_ADD_SEALS, 0x0010)  # F_SEAL_FUTURE_WRITE (Linux 5.1)
    expect(
        code.FAILED_PRECONDITION,
        "sealed against writes",
        attach,
        req(path=f"{mine}/{future}", size=mib, token=future_token),
    )
    r, w = os.pipe()  # never opened: opening a pipe or device can block or act
    expect(code.FAILED_PRECONDITION, "not a memory file", attach, req(path=f"{mine}/{r}", size=mib, token=token))
    expect(code.FAILED_PRECONDITION, "another host", attach, req(path="/proc/999999999/fd/3", size=mib, token=token))
    # and a proper one is taken, after all that
    assert attach(req(path=f"{mine}/{fd}", size=mib, token=token)).segment > 0
    for f in (fd, loose, sealed, future, plain, r, w):
        os.close(f)
    assert "Traceback" not in proc.log()


def test_bad_segment_references_change_nothing(ps_proc):
    s = stub(ps_proc)
    with PSClient(ps_proc.address, shared_memory=False) as ps:
        ps.create_table("t", dim=2)
        ids = np.arange(4, dtype=np.int64)
        ps.push("t", ids, np.ones((4, 2), np.float32))
    fd, token = _memfd(1 << 20)
    seg = s.AttachSegment(
        ps_pb2.AttachSegmentRequest(path=f"/proc/{os.getpid()}/fd/{fd}", size=1 << 20, token=token)
    ).segment
    pull = ps_pb2.PullRequest
    ref = ps_pb2.SegmentRef
    raw_push = grpc.insecure_channel(ps_proc.address).unary_unary(SERVICE + "Push")
    raw_push_many = grpc.insecure_channel(ps_proc.address).unary_unary(SERVICE + "PushMany")
    zeros = np.zeros((4, 2), np.float32)
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "not attached",
        s.Pull,
        pull(table="t", ids=ids.tobytes(), rows_to=ref(segment=seg + 1, offset=64, size=32)),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "inside segment",
        s.Pull,
        pull(table="t", ids=ids.tobytes(), rows_to=ref(segment=seg, offset=(1 << 20) - 16, size=32)),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "inside segment",
        s.Pull,
        pull(table="t", ids=ids.tobytes(), rows_to=ref(segment=seg, offset=0, size=32)),
    )  # over the token
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "another schema",
        s.Pull,
        pull(table="t", ids=ids.tobytes(), rows_to=ref(segment=seg, offset=64, size=48)),
    )
    expect(
        grpc.StatusCode.INVALID_ARGUMENT, "both", raw_push, b"".join(push_request_parts("t", ids, zeros, (seg, 64, 32)))
    )
    expect(
        grpc.StatusCode.FAILED_PRECONDITION,
        "not attached",
        raw_push,
        b"".join(push_request_parts("t", ids, None, (seg + 1, 64, 32))),
    )
    # a PushMany whose second entry is bad writes neither
    expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        "inside segment",
        raw_push_many,
        encode_push_many_request(
            [push_request_parts("t", ids, None, (seg, 64, 32)), push_request_parts("t", ids, None, (seg, 1 << 21, 32))]
        ),
    )
    with PSClient(ps_proc.address, shared_memory=False) as ps:
        assert np.array_equal(ps.pull("t", ids).rows, np.ones((4, 2), np.float32))  # nothing changed
    # a good one goes through the memory both map
    os.pwrite(fd, np.full((4, 2), 7, np.float32).tobytes(), 64)
    raw_push(b"".join(push_request_parts("t", ids, None, (seg, 64, 32))))
    reply = s.Pull(pull(table="t", ids=ids[::-1].tobytes(), rows_to=ref(segment=seg, offset=128, size=32)))
    assert reply.rows == b"" and reply.num_missing == 0
    assert np.array_equal(np.frombuffer(os.pread(fd, 32, 128), np.float32), np.full(8, 7, np.float32))
    assert s.DetachSegment(ps_pb2.DetachSegmentRequest(segment=seg)).detached
    assert not s.DetachSegment(ps_pb2.DetachSegmentRequest(segment=seg)).detached
    os.close(fd)


@pytest.mark.slow
def test_a_client_that_dies_leaves_nothing_behind(make_ps):
    """Its segment is dropped once idle; the memory goes with the last mapping (no file)."""
    proc = make_ps("--shm-idle-seconds", "0.5")
    code = (
        f"import numpy as np, os; from dynemb.ps_server.client import PSClient; ps = PSClient('{proc.address}'); "
        f"ps.create_table('t', dim=4); ps.pull('t', np.arange(9)); os._exit(0)"
    )
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert metric(proc, "dynemb_ps_shm_segments") == 1  # the client never detached
    time.sleep(1.0)  # idle past --shm-idle-seconds: time itself is the condition
    with PSClient(proc.address) as ps:
        ps.pull("t", np.arange(3))  # attaching sweeps the dead client's away
    assert metric(proc, "dynemb_ps_shm_segments") == 0  # and this client's was detached on close
