"""A batch refused by one owner's share of one table: every rank raises BatchRefused, and what
the other shares and tables did in the same call (admissions, evictions, pins) is finished,
not lost: every evicted row reaches the PS, every admitted slot holds its own row, nothing
stays pinned, and training goes on. The sharded transformer alone (one process, many tables),
the dynamic tables on one process over the embedded store, and on 2 torchrun ranks over a PS
process."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import TESTS, torchrun

from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.sharded import BatchRefused, ShardedIDTransformer, release_tables, transform_tables
from dynemb.idtransformer.transformer import NoRoom, TooManyIDs

sys.path.insert(0, str(TESTS / "dist"))

WORKER = TESTS / "dist" / "refused_batch_worker.py"


def _resident(t: ShardedIDTransformer) -> dict[int, int]:
    """id -> global slot of every resident ID."""
    slots = torch.nonzero(t.local.last_access != -1).squeeze(1)
    return dict(zip(t.local.slot_id[slots].tolist(), (slots + t.offset).tolist()))


@pytest.mark.parametrize("refusal", ["too_many", "too_many_torch", "no_room"])
def test_the_error_carries_the_shares_that_went_through(one_process_group, refusal):
    """transform_tables of four full tables, table 1 refused: the error holds what tables 0, 2
    and 3 did (their evictions and admissions account for every ID, their pins release), table
    1's result is empty and its slots -2."""
    backends = ["kernel", "torch" if refusal == "too_many_torch" else "kernel", "torch", "kernel"]
    tables = [ShardedIDTransformer(8, EvictionPolicy("lru", evict_fraction=0.25), backend=b) for b in backends]
    for k, t in enumerate(tables):
        t.transform(torch.arange(8) + 1000 * k)  # full
    held = t1_held = None
    if refusal == "no_room":  # every slot of table 1 pinned by a batch in flight
        held = transform_tables(tables[1:2], [torch.arange(8) + 1000], pin=True)
        t1_held = held[0].pinned.clone()
    before = [_resident(t) for t in tables]
    n_new = 10 if refusal != "no_room" else 3  # 10 > 8 slots: too many; 3 new with 0 movable: no room
    batch = [torch.tensor([1000 * k + 1, 1000 * k + 2] + list(range(1000 * k + 500, 1000 * k + 504))) for k in range(4)]
    batch[1] = torch.arange(n_new) + 1500
    with pytest.raises(BatchRefused) as caught:
        transform_tables(tables, batch, pin=True)
    e = caught.value
    assert isinstance(e.__cause__, TooManyIDs if refusal != "no_room" else NoRoom) and e.errors[1] is e.__cause__
    assert e.errors[0] is e.errors[2] is e.errors[3] is None and e.refused_by == [[], [0], [], []]
    assert "rank 0 refused its share of table 1" in str(e)
    assert len(e.results) == 4 and e.results[1].slots.tolist() == [-2] * n_new
    assert e.results[1].owned.admitted_ids.numel() == e.results[1].owned.evicted_ids.numel() == 0
    assert _resident(tables[1]) == before[1]  # the refused table admitted and evicted nothing
    for k in (0, 2, 3):
        out, after = e.results[k].owned, _resident(tables[k])
        assert len(out.evicted_ids) > 0
        assert sorted(out.admitted_ids.tolist()) == list(range(1000 * k + 500, 1000 * k + 504))
        # every ID before, or admitted, is resident now or in the evictions (to push): none lost
        evicted = dict(zip(out.evicted_ids.tolist(), out.evicted_slots.tolist()))
        assert set(before[k]) | set(out.admitted_ids.tolist()) == set(after) | set(evicted)
        assert all(before[k][i] == s for i, s in evicted.items())  # the rows to push are at those slots
        assert [after[i] for i in batch[k].tolist()] == e.results[k].slots.tolist()
        assert int(tables[k].local.pins.sum()) == len(batch[k])
    release_tables(tables, e.results)  # the refused table's empty result releases nothing
    if held is not None:
        assert torch.equal(tables[1].local.pins[t1_held], torch.ones(8, dtype=torch.uint8))
        release_tables(tables[1:2], held)
    assert [int(t.local.pins.sum()) for t in tables] == [0, 0, 0, 0]
    out = transform_tables(tables, [b[:4] for b in batch], pin=True)  # a smaller batch goes through
    assert all(bool((o.slots >= 0).all()) for o in out)
    release_tables(tables, out)


@pytest.mark.parametrize("shared,ahead", [(True, 0), (False, 1)], ids=["one-storage", "per-table-ahead"])
@pytest.mark.torchrec
def test_dynamic_tables_finish_a_refused_batch_on_one_process(one_process_group, shared, ahead):
    from refused_batch_worker import Scenario

    from dynemb.tables.row_store import LocalRowStore

    Scenario(LocalRowStore(), shared, ahead).run()


@pytest.mark.dist
@pytest.mark.parametrize("shared,ahead", [(True, 0), (False, 1)], ids=["one-storage", "per-table-ahead"])
@pytest.mark.torchrec
def test_dynamic_tables_finish_a_refused_batch_on_two_ranks(shared, ahead):
    run = torchrun(2, WORKER, "shared" if shared else "separate", str(ahead))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in range(2):
        assert f"OK rank {rank}" in run.stdout
