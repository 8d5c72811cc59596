"""`dynemb demo`: the PS on its own. Starts a PS on the embedded store, creates a table, pulls
and pushes rows through the client, and prints what happened. The training job is `dynemb train`."""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
from tqdm import tqdm


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `demo` to the `dynemb` command's subparsers `sub`."""
    p = sub.add_parser(
        "demo",
        help="start a PS on the embedded store, create a table, pull and push rows, print what happened",
        description="The PS on its own: a PS on the embedded store (or --backend), one table, "
        "a few rounds of pull → update → push through PSClient, then the PS's stats.",
    )
    p.add_argument("--backend", default="", help="PS backend URL [default: embedded]")
    p.add_argument("--rows", type=int, default=200_000, help="distinct ids to write [default %(default)s]")
    p.add_argument("--batch", type=int, default=16384, help="ids per pull/push [default %(default)s]")
    p.add_argument("--dim", type=int, default=64, help="embedding dim [default %(default)s]")
    p.add_argument("--state-width", type=int, default=64, help="optimizer-state values per row [default %(default)s]")
    p.set_defaults(func=run)


def run(args) -> int:
    """`dynemb demo`: start a PS, pull and push through the client, print what happened."""
    from dynemb.ps_server.client import PSClient
    from dynemb.ps_server.schema import Initializer
    from dynemb.ps_server.server import PSServer, ServeConfig

    logging.basicConfig(level=logging.WARNING)
    server = PSServer(ServeConfig(address="127.0.0.1:0", backend=args.backend, metrics_port=0)).start()
    print(f"PS up on 127.0.0.1:{server.port} ({server.store.kind} store), metrics on :{server.metrics_port}/metrics")
    try:
        with PSClient(f"127.0.0.1:{server.port}") as ps:
            info = ps.create_table(
                "demo_items",
                dim=args.dim,
                state_width=args.state_width,
                initializer=Initializer("uniform", -0.05, 0.05, seed=7),
            )
            s = info.schema
            print(
                f"created table {s.name}: dim={s.dim} state_width={s.state_width} dtype={s.dtype} "
                f"init={s.initializer.kind}[{s.initializer.a}, {s.initializer.b})"
            )

            rng = np.random.default_rng(0)
            ids = rng.choice(1 << 62, size=args.rows, replace=False).astype(np.int64)
            pulled = pushed = missing = 0
            start = time.perf_counter()
            for lo in tqdm(range(0, len(ids), args.batch), desc="pull+push", unit="batch"):
                batch = ids[lo : lo + args.batch]
                got = ps.pull(s.name, batch)
                missing += int(got.missing.sum())
                rows = got.rows.copy()
                rows[:, : s.dim] -= 0.01  # stand-in for a gradient step
                rows[:, s.dim :] += 1.0  # and its optimizer-state update
                ps.push(s.name, batch, rows)
                pulled += len(batch)
                pushed += len(batch)
            elapsed = time.perf_counter() - start
            print(
                f"pulled {pulled} rows ({missing} missing, returned initialised) and pushed {pushed} rows "
                f"in {elapsed:.2f}s: {(pulled + pushed) / elapsed:,.0f} rows/s"
            )

            sample = ids[:3]
            again = ps.pull(s.name, sample)
            print(
                f"pulled {len(sample)} ids again: missing={again.missing.tolist()}, "
                f"first values {np.round(again.embeddings[:, 0], 4).tolist()}, "
                f"state {again.state[:, 0].tolist()}"
            )
            info = ps.describe_table(s.name)
            print(f"table {s.name} now holds {info.num_rows} rows")
            for m in ps.stats()[0].methods:
                print(f"  {m.method:<12} requests={m.requests:<4} errors={m.errors} rows={m.rows}")
    finally:
        server.stop(grace=1.0)
    print("PS stopped")
    return 0
