"""Dynamic tables through a refused batch: run by torchrun from tests/tables/test_refused_batch.py
(2 ranks, a PS process started by rank 0) and called in-process by it (1 rank, the embedded
store).

Three tables warm up until they evict; then rank 0's batch brings table a more distinct IDs
than a rank's block holds, so rank 0 refuses its share of table a, while the other shares
(table a on rank 1, tables b and c everywhere) admit and evict. With 2 ranks, rank 1's batch
asks rank 0 for nothing: it learns of the refusal only through the agreement. Every rank
must raise, and afterwards: every ID a batch trained has its latest row where it should be
(resident at its slot, or on the PS), every resident slot holds its own ID's row (trained, or
as the PS initialises it), nothing is pinned; training goes on with smaller batches, and in
the end the PS holds every trained row."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import leave_process_groups  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from dynemb.idtransformer.hashing import owner_of  # noqa: E402
from dynemb.idtransformer.policy import EvictionPolicy  # noqa: E402
from dynemb.idtransformer.sharded import BatchRefused  # noqa: E402
from dynemb.idtransformer.transformer import TooManyIDs  # noqa: E402
from dynemb.ps_server.initializer import initial_rows  # noqa: E402
from dynemb.ps_server.schema import Initializer, TableSchema  # noqa: E402
from dynemb.tables.dynamic import DynamicTables, DynamicTableSpec  # noqa: E402
from dynemb.tables.table_rows import TableRows  # noqa: E402

TABLES = {"a": 16, "b": 16, "c": 12}  # rows per rank
DIM, UNIVERSE = 4, 300


def schema(name: str) -> TableSchema:
    return TableSchema(f"refused_{name}", DIM, state_width=1, initializer=Initializer("uniform", -0.5, 0.5, seed=3))


def make_rows(rank: int, shared: bool) -> dict[str, TableRows]:
    """Each table's block of rows (weights and one state column); with shared, views of one
    storage each, as a TBE's tables are (RowGroup's one gather for all)."""
    total = sum(TABLES.values())
    weights, state = torch.zeros(total, DIM), torch.zeros(total, 1)
    rows, at = {}, 0
    for name, n in TABLES.items():
        w, s = (weights[at:at + n], state[at:at + n]) if shared else (torch.zeros(n, DIM), torch.zeros(n, 1))
        rows[name] = TableRows(name, w, [s], rank * n)
        at += n
    return rows


class Scenario:
    def __init__(self, store, shared: bool, ahead: int) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store, self.ahead = store, ahead
        self.rows = make_rows(self.rank, shared)
        specs = [DynamicTableSpec(name, [f"f_{name}"], schema(name), EvictionPolicy("lru", evict_fraction=0.25))
                 for name in TABLES]
        self.dyn = DynamicTables(self.rows, specs, store)
        self.dyn.ahead = ahead  # as wrap(ahead=1) sets it: a batch's rows settle by the next call
        self.truth: dict[str, dict[int, np.ndarray]] = {name: {} for name in TABLES}  # trained rows I own
        self.step = 0
        self.fresh_at = {name: 100_000 * (k + 1) + 10_000 * self.rank for k, name in enumerate(TABLES)}

    def fresh(self, name: str, owner: int, n: int) -> list[int]:
        """n IDs of table `name` never used before, owned by `owner`."""
        out: list[int] = []
        while len(out) < n:
            i = self.fresh_at[name]
            self.fresh_at[name] += 1
            if int(owner_of(torch.tensor([i]), self.world)) == owner:
                out.append(i)
        return out

    def transform(self, ids: dict[str, list[int]]) -> None:
        values = torch.tensor([i for name in TABLES for i in ids.get(name, [])], dtype=torch.int64)
        lengths = torch.tensor([len(ids.get(name, [])) for name in TABLES], dtype=torch.int32)
        kjt = KeyedJaggedTensor(keys=[f"f_{name}" for name in TABLES], values=values, lengths=lengths)
        self.dyn.transform(kjt)

    def train_step(self, ids: dict[str, list[int]]) -> None:
        """Transform, then 'train': every row of the batch that this rank owns (each its ID's
        latest row, or a new ID's initial one) moves by a value of its own, and the truth keeps
        it; then the batch is released."""
        self.transform(ids)
        self.dyn.settle()  # (with ahead=1 the pulled rows are written in by now at the latest)
        self.step += 1
        for k, name in enumerate(TABLES):
            t, r = self.dyn.transformers[name], self.rows[name]
            owned = self.dyn.in_flight[-1][k].owned
            local = torch.unique(owned.slots[owned.slots >= 0]) - t.offset
            if not len(local):
                continue
            ids = t.local.slot_id[local].tolist()
            old = r.read(local)
            init = initial_rows(schema(name), np.array(ids, dtype=np.int64)).astype(np.float32)
            for i, row, fresh in zip(ids, old.numpy(), init):
                want = self.truth[name].get(i, fresh)
                assert np.array_equal(row, want), f"step {self.step}: table {name}: id {i} came with {row}, not {want}"
            r.write(local, old + torch.tensor([float(self.step)] * DIM + [0.5]))
            for i, row in zip(ids, r.read(local).numpy()):
                self.truth[name][i] = row
        self.dyn.release_oldest()

    def random_ids(self, gen: torch.Generator, n: int) -> dict[str, list[int]]:
        return {name: torch.randint(0, UNIVERSE, (n,), generator=gen).tolist() for name in TABLES}

    def check(self, where: str) -> None:
        """Every trained row where it should be, every resident slot holding its own row, no pins."""
        self.dyn.settle()
        for name, t in self.dyn.transformers.items():
            local, truth = t.local, self.truth[name]
            slots = torch.nonzero(local.last_access != -1).squeeze(1)
            ids = local.slot_id[slots].tolist()
            rows = self.rows[name].read(slots).numpy()
            init = initial_rows(schema(name), np.array(ids, dtype=np.int64)).astype(np.float32)
            for i, row, fresh in zip(ids, rows, init):
                want = truth.get(i, fresh)
                assert np.array_equal(row, want), f"{where}: table {name}: resident id {i} holds {row}, not {want}"
            gone = np.array(sorted(set(truth) - set(ids)), dtype=np.int64)
            if len(gone):
                got = self.store.pull(schema(name).name, gone)
                for i, row in zip(gone.tolist(), got):
                    assert np.array_equal(row, truth[i]), f"{where}: table {name}: evicted id {i} lost on the PS"
            assert int(local.pins.sum()) == 0, f"{where}: table {name}: pins left on rank {self.rank}"

    def run(self) -> dict[str, int]:
        rank, world = self.rank, self.world
        gen = torch.Generator().manual_seed(10 + rank)
        for _ in range(16):  # the tables fill and evict
            self.train_step(self.random_ids(gen, 6))
        self.check("after warm-up")
        # the refused batch: new IDs, and some resident ones
        if rank == 0:
            ids = {"a": self.fresh("a", 0, TABLES["a"] + 4),  # more than rank 0's block of a: refused
                   "b": [i for o in range(world) for i in self.fresh("b", o, 3)],
                   "c": [i for o in range(world) for i in self.fresh("c", o, 3)]}
        else:  # only IDs rank 1 owns: it asks rank 0 nothing
            ids = {name: self.fresh(name, rank, n) for name, n in (("a", 6), ("b", 3), ("c", 3))}
        for name in ("b", "c"):  # and two resident IDs this rank owns (hits, pinned)
            local = self.dyn.transformers[name].local
            ids[name] = local.slot_id[torch.nonzero(local.last_access != -1).squeeze(1)[:2]].tolist() + ids[name]
        try:
            self.transform(ids)
            raise AssertionError(f"rank {rank}: a batch with too many IDs for table a went through")
        except BatchRefused as e:
            assert e.refused_by == [[0], [], []], e.refused_by
            if rank == 0:
                assert isinstance(e.__cause__, TooManyIDs) and e.errors[0] is e.__cause__, repr(e.__cause__)
                assert f"{TABLES['a'] + 4} distinct IDs but the table holds {TABLES['a']}" in str(e), str(e)
            else:
                assert e.__cause__ is None and e.errors == [None] * 3, e.errors
                assert "rank 0 refused its share of table a" in str(e), str(e)  # named, not numbered
            moved = {name: (len(out.owned.evicted_ids), len(out.owned.admitted_ids))
                     for name, out in zip(TABLES, e.results)}
            evicted = {name: out.owned.evicted_ids.tolist() for name, out in zip(TABLES, e.results)}
        # the shares that went through did evict and admit: what must not be lost
        for name in ("a", "b", "c") if rank > 0 else ("b", "c"):
            assert min(moved[name]) > 0, f"rank {rank} table {name}: {moved[name]} (evicted, admitted)"
        assert not self.dyn.in_flight and not self.dyn._moving  # the refused batch is not in flight
        self.check("after the refused batch")
        # training goes on: smaller batches, with some of the IDs the refused batch admitted,
        # evicted (they come back with their rows: train_step checks) or was refused
        for k in range(6):
            smaller = self.random_ids(gen, 3)
            for name in TABLES:
                smaller[name] += ids[name][k * 2:k * 2 + 2] + evicted[name][k * 2:k * 2 + 2]
            self.train_step(smaller)
        self.check("after training on")
        self.dyn.flush()
        for name in TABLES:  # the PS holds every trained row
            truth = self.truth[name]
            got = self.store.pull(schema(name).name, np.array(sorted(truth), dtype=np.int64))
            assert np.array_equal(got, np.stack([truth[i] for i in sorted(truth)])), f"table {name} after flush"
        return {name: len(self.truth[name]) for name in TABLES}


def main() -> None:
    import faulthandler

    from dynemb.tables.row_store import RemoteRowStore

    faulthandler.dump_traceback_later(200, exit=True)  # a hung collective prints its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ps = None
    if rank == 0:
        from dynemb.testing.local_ps import LocalPS

        ps = LocalPS("--log-level", "WARNING").start()
    address = [ps.address if ps else None]
    dist.broadcast_object_list(address, src=0)
    store = RemoteRowStore(address[0])
    shared, ahead = sys.argv[1] == "shared", int(sys.argv[2])
    trained = Scenario(store, shared, ahead).run()  # (a failure: the PS ends with this process)
    store.close()
    dist.barrier()  # every rank done with rank 0's PS
    if ps is not None:
        ps.close()
    print(f"OK rank {rank}: trained rows {trained}", flush=True)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
