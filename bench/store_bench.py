"""EmbeddedStore in-process, no gRPC: the cost of pull/push as the trainer's step sends them
(26 tables x 320 ids) and of big batches (16k ids from a 1M-row table).

    .venv/bin/python bench/store_bench.py            # median of --repeat timings per case
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.ps_server.backends.embedded import EmbeddedStore  # noqa: E402
from dynemb.ps_server.schema import TableSchema  # noqa: E402


def median_s(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_case(repeat: int, rng) -> dict:
    """26 tables of 100k rows; each call moves 320 ids per table, about half of them new to the
    table on the first push (a fresh store per timing would measure allocation, not steady state)."""
    store = EmbeddedStore()
    names = [f"t{i}" for i in range(26)]
    for name in names:
        store.create_table(TableSchema(name=name, dim=16))
        ids = rng.choice(1 << 40, 100_000, replace=False).astype(np.int64)
        store.push(name, ids, rng.random((len(ids), 16), dtype=np.float32))
    batches = {n: rng.choice(1 << 40, 320, replace=False).astype(np.int64) for n in names}
    rows = rng.random((320, 16), dtype=np.float32)

    def pull():
        for n in names:
            store.pull(n, batches[n])

    def push():
        for n in names:
            store.push(n, batches[n], rows)

    return {"pull 26x320 ms": 1e3 * median_s(pull, repeat), "push 26x320 ms": 1e3 * median_s(push, repeat)}


def big_case(repeat: int, rng) -> dict:
    store = EmbeddedStore()
    schema = TableSchema(name="big", dim=64, state_width=64)  # as bench/ps_bench.py
    store.create_table(schema)
    ids = rng.choice(1 << 50, 1_000_000, replace=False).astype(np.int64)
    start = time.perf_counter()
    for lo in range(0, len(ids), 65536):
        chunk = ids[lo : lo + 65536]
        store.push("big", chunk, rng.random((len(chunk), schema.width), dtype=np.float32))
    load_s = time.perf_counter() - start
    batch = rng.choice(ids, 16384, replace=False)
    rows = rng.random((len(batch), schema.width), dtype=np.float32)
    pull = median_s(lambda: store.pull("big", batch), repeat)
    push = median_s(lambda: store.push("big", batch, rows), repeat)
    index = store._tables["big"].index
    return {
        "load 1M rows s": load_s,
        "pull 16k Mrows/s": len(batch) / pull / 1e6,
        "push 16k Mrows/s": len(batch) / push / 1e6,
        "index bytes/entry": index.nbytes() / len(index),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    out = {**step_case(args.repeat, rng), **big_case(args.repeat, rng)}
    for k, v in out.items():
        print(f"{k:22s} {v:8.3f}")


if __name__ == "__main__":
    main()
