"""What one small request may make a PS (`dynemb ps serve`) do: tables no wider than
--max-row-width, pulls and pushes of at most --max-request-mb of rows (in the message or through
shared memory), checked before any work, and rows never pushed initialised without temporaries
several times their size. A 4 KB pull of 511 new ids of a 65,536-wide fp16 table took the PS to
+1.3 GB; four at once to +4.2 GB; one into a 256 MiB sparse memfd to +5.4 GB."""

from __future__ import annotations

import fcntl
import os
import threading

import grpc
import numpy as np
import psutil
import pytest
from helpers import dynemb

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server import shm
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.schema import Initializer

pytestmark = pytest.mark.slow

WIDE = 65536
MIB = 1 << 20


def peak_rss(pid: int) -> int:
    """The process's peak resident memory since the last reset_peak (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def reset_peak(pid: int) -> int:
    """Start a new peak (clear_refs 5) and return the resident memory now (psutil)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return psutil.Process(pid).memory_info().rss


def status_of(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60)
    return info.value


@pytest.fixture
def wide_ps(make_ps):
    """A PS allowed rows of 65,536 values, with a fp16 table of them (normal init), and a stub."""
    proc = make_ps("--max-row-width", str(WIDE), "--shm-max-mb", "1024")
    with PSClient(proc.address) as ps:
        ps.create_table("wide", dim=WIDE, dtype="fp16", initializer=Initializer("normal", 0.0, 0.1, 5))
    channel = grpc.insecure_channel(proc.address, options=[("grpc.max_receive_message_length", 128 * MIB)])
    yield proc, ps_pb2_grpc.ParameterServerStub(channel)
    channel.close()


def test_a_table_wider_than_the_limit_is_refused(make_ps):
    proc = make_ps()
    with grpc.insecure_channel(proc.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        spec = ps_pb2.TableSpec(name="wide", dim=WIDE, dtype=ps_pb2.FP16)
        err = status_of(stub.CreateTable, ps_pb2.CreateTableRequest(spec=spec))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "16384" in err.details() and "--max-row-width" in err.details()
        spec = ps_pb2.TableSpec(name="fits", dim=16000, state_width=384, dtype=ps_pb2.FP32)
        assert stub.CreateTable(ps_pb2.CreateTableRequest(spec=spec), timeout=60).created


def test_pulls_of_wide_new_rows_keep_the_ps_small(wide_ps):
    proc, stub = wide_ps
    pid = proc.proc.pid
    ids = np.arange(511, dtype=np.int64)
    request = ps_pb2.PullRequest(table="wide", ids=ids.tobytes())
    assert len(request.ids) < 4096
    one = stub.Pull(request, timeout=120)  # warm up: the first reply's buffers, the id index
    assert one.num_missing == 511 and len(one.rows) == 511 * WIDE * 2
    rows = np.frombuffer(one.rows, np.float16).astype(np.float32)
    assert np.isfinite(rows).all() and 0.09 < rows.std() < 0.11

    before = reset_peak(pid)
    replies: list = []
    threads = [threading.Thread(target=lambda: replies.append(stub.Pull(request, timeout=120))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = peak_rss(pid) - before
    assert len(replies) == 4 and all(r.rows == one.rows for r in replies)
    # four 64 MiB replies and grpc's copy of each, and temporaries of a few MiB (the old code: +4.2 GB)
    assert grown < 4 * 2 * 64 * MIB + 150 * MIB, f"the PS grew {grown / MIB:.0f} MiB for four 4 KB pulls"


def sparse_segment(size: int) -> tuple[int, bytes]:
    """A memfd of `size` bytes, sealed as the PS wants it but never allocated: it costs its maker
    nothing until someone writes to it."""
    fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    token = os.urandom(shm.TOKEN_BYTES)
    os.pwrite(fd, token, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd, token


def test_a_pull_into_shared_memory_is_capped_like_a_reply(wide_ps):
    proc, stub = wide_ps
    pid = proc.proc.pid
    size = 256 * MIB
    fd, token = sparse_segment(size)
    try:
        attach = ps_pb2.AttachSegmentRequest(path=f"/proc/{os.getpid()}/fd/{fd}", size=size, token=token)
        segment = stub.AttachSegment(attach, timeout=60).segment
        row_bytes = WIDE * 2
        n = (size - shm.ROWS_START) // row_bytes  # 2047 rows: the whole segment
        ids = np.arange(n, dtype=np.int64)

        def pull(k: int) -> ps_pb2.PullRequest:
            ref = ps_pb2.SegmentRef(segment=segment, offset=shm.ROWS_START, size=k * row_bytes)
            return ps_pb2.PullRequest(table="wide", ids=ids[:k].tobytes(), rows_to=ref)

        before = reset_peak(pid)
        err = status_of(stub.Pull, pull(n))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-request-mb" in err.details() and str(64 * MIB) in err.details()
        assert peak_rss(pid) - before < 32 * MIB  # refused before any work
        # the most one request may ask for: its rows (pages of the memfd the PS fills) and little more
        fits = 64 * MIB // row_bytes
        before = reset_peak(pid)
        reply = stub.Pull(pull(fits), timeout=120)
        assert reply.num_missing == fits and not reply.rows
        grown = peak_rss(pid) - before
        assert grown < 64 * MIB + 100 * MIB, f"the PS grew {grown / MIB:.0f} MiB for a 64 MiB pull"
        got = np.frombuffer(os.pread(fd, fits * row_bytes, shm.ROWS_START), np.float16).astype(np.float32)
        assert np.isfinite(got).all() and 0.09 < got.std() < 0.11
    finally:
        os.close(fd)


def test_a_push_of_more_rows_than_the_limit_is_refused(make_ps):
    proc = make_ps("--max-request-mb", "1")
    with PSClient(proc.address, shared_memory=False) as ps, grpc.insecure_channel(proc.address) as channel:
        ps.create_table("t", dim=256)
        ids = np.arange(2000, dtype=np.int64)  # 2000 rows of 1 KiB: 2 MB
        rows = np.ones((2000, 256), np.float32)
        push = ps_pb2.PushRequest(table="t", ids=ids.tobytes(), rows=rows.tobytes())
        err = status_of(ps_pb2_grpc.ParameterServerStub(channel).Push, push)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-request-mb" in err.details()
        assert ps.describe_table("t").num_rows == 0
        assert ps.push("t", ids[:1000], rows[:1000]) == 1000


def test_serve_help_names_the_limits():
    out = dynemb("ps", "serve", "--help", check=True)
    text = " ".join(out.stdout.split())
    for flag, env in (("--max-row-width", "DYNEMB_PS_MAX_ROW_WIDTH"), ("--max-request-mb", "DYNEMB_PS_MAX_REQUEST_MB")):
        assert flag in text and env in text
    assert "bounds the memory one request makes the PS use" in text
    assert "refused with UNAVAILABLE" in text  # the drain, in the epilog
