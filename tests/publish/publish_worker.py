"""Run by torchrun from tests/publish/test_publish_job.py: an own model with dynamic tables over
a PS trains in segments; after each, publish_tables cuts a version of each table and rank 0
checks that the chain (full + deltas), replayed, is the PS's rows at the cut, bit for bit, while
the other ranks wait; then that every rank pushing all its resident rows changes no row (the
publish left none unpushed that training changed). Between segments rank 0 deletes rows on the
PS, some of them resident.
Writes OUT/result.json on rank 0. Arguments: OUT, the PS address."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tables"))

from helpers import leave_process_groups  # noqa: E402
from published import replay, same  # noqa: E402
from tables_dist_worker import CAPACITY, batches  # noqa: E402
from tables_models import CONFIGS, build, train_step  # noqa: E402

from dynemb import tables as dt  # noqa: E402
from dynemb.ps_server.client import PSClient  # noqa: E402
from dynemb.publish import PublishConfig, publish_tables  # noqa: E402

SEGMENTS, STEPS = 3, 8


def run(out: str, address: str, rank: int) -> list[dict]:
    root = os.path.join(out, "published")
    config = PublishConfig(root, full_every=100)
    model, dense = build(CAPACITY)
    checks = []
    with dt.DynamicEmbeddings(model, CONFIGS, store=address, table_prefix="pub_") as dyn, PSClient(address) as ps:
        stream = batches(rank, SEGMENTS * STEPS)
        for segment in range(SEGMENTS):
            for batch in dyn.wrap(next(stream) for _ in range(STEPS)):
                train_step(model, dense, batch.sparse_features, batch.labels)
            if segment and rank == 0:  # rows leave the PS between versions (some resident: pushed back later)
                for name in dyn.names:
                    ps.delete(dyn.schemas[name].name, np.arange(0, 400, 7))
            dist.barrier()
            versions = publish_tables(dyn, config, (segment + 1) * STEPS)
            cut = {}
            if rank == 0:  # the PS at the cut, against the chain replayed
                for name, v in versions.items():
                    table = dyn.schemas[name].name
                    cut[name] = export(ps, table, v.dim)
                    got = replay(root, table)
                    exact = same(got, cut[name])
                    checks.append({"table": name, "number": v.number, "kind": v.kind, "rows": v.rows,
                                   "deleted": v.deleted, "stored": len(cut[name]), "exact": exact})  # fmt: skip
            dist.barrier()
            # the publish pushed every row looked up since the last: none is left to push, and
            # pushing every resident row changes no row on the PS (but the deleted ones it brings back)
            again = dyn.flush(changed_only=True)
            resident = dyn.resident_rows()
            dyn.flush()
            dist.barrier()
            if rank == 0:
                for name, check in zip(versions, checks[-len(versions) :]):
                    after = export(ps, dyn.schemas[name].name, versions[name].dim)
                    kept = {i: r for i, r in after.items() if i % 7}
                    check.update(pushed_again=again, resident=resident,
                                 flushed_all=same(kept, {i: r for i, r in cut[name].items() if i % 7}))  # fmt: skip
            dist.barrier()  # no rank pushes while rank 0 reads the PS
    return checks


def export(ps: PSClient, table: str, dim: int) -> dict[int, np.ndarray]:
    out = {}
    for ids, rows in ps.export(table):
        out.update(zip(ids.tolist(), rows[:, :dim]))
    return out


def main() -> None:
    out, address = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = run(out, address, rank)  # its model and tables gone before the groups are left
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(checks, f)
    leave_process_groups()


if __name__ == "__main__":
    main()
