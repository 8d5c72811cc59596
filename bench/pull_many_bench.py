"""PullMany and PushMany cost by entries: N one-id entries against one entry of the same N ids.

    .venv/bin/python bench/pull_many_bench.py                  # 200,000 ids; embedded and Redis
    .venv/bin/python bench/pull_many_bench.py --ids 20000 --rounds 5

One table of dim 4 (fp32), N rows pushed first. Each round sends, through raw gRPC (requests
built beforehand, replies not parsed: the PS's own cost), a PullMany of N entries of one id
each and a PullMany of one entry of all N ids, alternately, then the same two shapes as
PushMany. Prints each shape's median seconds and the ratio many / one (goal: within 2x), the
PS process's CPU seconds a call of each shape (from /proc, summed over the rounds: less moved
by other load on the machine than wall time), and the many-entry pull at N/100, N/10 and N
entries (linear: the per-entry time stays flat). The PS runs with --max-request-entries N (its
default bounds entries at 65,536).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.protos import ps_pb2  # noqa: E402
from dynemb.ps_server.client import PSClient  # noqa: E402
from dynemb.testing.local_ps import LocalPS  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402

DIM = 4


def pull_many(ids: np.ndarray, per_entry: int) -> bytes:
    entries = [
        ps_pb2.PullRequest(table="t", ids=ids[k : k + per_entry].tobytes()) for k in range(0, len(ids), per_entry)
    ]
    return ps_pb2.PullManyRequest(pulls=entries).SerializeToString()


def push_many(ids: np.ndarray, rows: np.ndarray, per_entry: int) -> bytes:
    entries = [
        ps_pb2.PushRequest(table="t", ids=ids[k : k + per_entry].tobytes(), rows=rows[k : k + per_entry].tobytes())
        for k in range(0, len(ids), per_entry)
    ]
    return ps_pb2.PushManyRequest(pushes=entries).SerializeToString()


def timed(call, request: bytes) -> float:
    start = time.perf_counter()
    call(request, timeout=600)
    return time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU seconds so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(address: str, n: int, rounds: int, pid: int) -> dict[str, float]:
    ids = np.arange(n, dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((n, DIM)).astype(np.float32)
    with PSClient(address, timeout=600) as client:
        client.create_table("t", dim=DIM)
        client.push("t", ids, rows)
    limit = 256 << 20
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    )
    methods = {
        name: channel.unary_unary(f"/dynemb.ps.v1.ParameterServer/{name}", request_serializer=bytes)
        for name in ("PullMany", "PushMany")
    }
    requests = {
        "pull": (methods["PullMany"], pull_many(ids, 1), pull_many(ids, n)),
        "push": (methods["PushMany"], push_many(ids, rows, 1), push_many(ids, rows, n)),
    }
    out: dict[str, float] = {}
    for what, (call, many, one) in requests.items():
        timed(call, one)  # warm-up
        times_many, times_one = [], []
        cpu_many = cpu_one = 0.0
        for _ in range(rounds):
            before = cpu_seconds(pid)
            times_many.append(timed(call, many))
            middle = cpu_seconds(pid)
            times_one.append(timed(call, one))
            cpu_many, cpu_one = cpu_many + middle - before, cpu_one + cpu_seconds(pid) - middle
        out[f"{what}_many_s"], out[f"{what}_one_s"] = statistics.median(times_many), statistics.median(times_one)
        out[f"{what}_ratio"] = out[f"{what}_many_s"] / out[f"{what}_one_s"]
        print(
            f"  {what}: {n:,} one-id entries {out[f'{what}_many_s']:.3f} s, one {n:,}-id entry "
            f"{out[f'{what}_one_s']:.3f} s, ratio {out[f'{what}_ratio']:.2f} ({len(many):,} B request); "
            f"PS CPU a call {cpu_many / rounds:.3f} s against {cpu_one / rounds:.3f} s, "
            f"ratio {cpu_many / max(cpu_one, 1e-9):.2f}",
            flush=True,
        )
    for k in (n // 100, n // 10, n):
        seconds = statistics.median(timed(methods["PullMany"], pull_many(ids[:k], 1)) for _ in range(rounds))
        print(f"  pull of {k:,} one-id entries: {seconds:.3f} s, {seconds / k * 1e6:.2f} us an entry", flush=True)
    channel.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("embedded", "redis"))
    args = parser.parse_args()
    limit = ("--max-request-entries", str(args.ids), "--max-message-mb", "256", "--log-level", "WARNING")
    if args.only in (None, "embedded"):
        print("embedded store:", flush=True)
        with LocalPS(*limit) as ps:
            bench(ps.address, args.ids, args.rounds, ps.proc.pid)
    if args.only in (None, "redis"):
        print("Redis store (a redis-server of its own):", flush=True)
        with RedisProcess() as redis, LocalPS("--backend", redis.url, *limit) as ps:
            bench(ps.address, args.ids, args.rounds, ps.proc.pid)


if __name__ == "__main__":
    main()
