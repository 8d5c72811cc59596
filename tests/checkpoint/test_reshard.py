"""A checkpoint of 2 torchrun ranks restored onto 1 and onto 3 (resharding): every row with its
optimizer state comes back as the 2-rank job left it, each rank's rebuilt ID transformers hold
only IDs it owns now, with the checkpoint's rows in their slots, and training goes on from the
same global data position."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TESTS, torchrun

from dynemb.checkpoint.format import chain, checkpoints, read_manifest
from dynemb.checkpoint.table_files import TableReader
from dynemb.idtransformer.hashing import owner_of

WORKER = TESTS / "dist" / "reshard_worker.py"
BATCH = 48  # helpers.config's batch size per rank


def whole_tables(out: Path, phase: str, world: int, tag: str) -> dict[str, np.ndarray]:
    """Every rank's block of every table, joined: the rows of IDs 0 .. universe - 1."""
    parts = [np.load(out / f"{phase}-{world}-rank{r}.npz") for r in range(world)]
    names = [k[len(f"{tag}_table_") :] for k in parts[0].files if k.startswith(f"{tag}_table_")]
    return {n: np.concatenate([p[f"{tag}_table_{n}"] for p in parts]) for n in names}


def run(world: int, out: Path, *args: str) -> None:
    done = torchrun(world, WORKER, str(out), *args, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)  # four torchrun jobs; 3 ranks on a small machine take a minute
@pytest.mark.parametrize(
    "optimizer,tables,ps,worlds",
    [
        ("adam", "dynamic", "", (1, 3)),
        ("adagrad", "dynamic", "process", (3,)),
        ("rowwise_adagrad", "full", "", (1, 3)),
    ],
    ids=["dynamic-in-process-adam", "dynamic-ps-process", "full-tables"],
)
@pytest.mark.torchrec
def test_two_ranks_resume_on_fewer_and_on_more(tmp_path, optimizer, tables, ps, worlds):
    from dynemb.testing.local_ps import LocalPS

    with contextlib.ExitStack() as stack:
        address = stack.enter_context(LocalPS()).address if ps else ""
        run(2, tmp_path, "first", optimizer, tables, address)
        assert [read_manifest(c)["world_size"] for c in checkpoints(tmp_path / "ck")] == [2, 2]
        want = whole_tables(tmp_path, "first", 2, "first")
        assert len(want) == 6
        for world in worlds:
            run(world, tmp_path, "resume", optimizer, tables, address)
            got = whole_tables(tmp_path, "resume", world, "restored")
            assert got.keys() == want.keys()
            for name, rows in want.items():  # rows and optimizer state, as the 2-rank job left them
                np.testing.assert_array_equal(got[name], rows, err_msg=f"{world} ranks, table {name}")
            saved = read_manifest(tmp_path / f"ck{world}" / "step-00000030")
            start = 20 * 2 // world  # each rank's batch: 40 batches of 48 taken by the 2 ranks
            assert saved["world_size"] == world and saved["samples"] == (start + 10) * BATCH * world
            for r in range(world):
                got_r = np.load(tmp_path / f"resume-{world}-rank{r}.npz")
                assert int(got_r["restored_first_step"]) == 20 and len(got_r["restored_losses"]) == 0
                assert int(got_r["trained_first_step"]) == 20 and int(got_r["trained_data_start"]) == start
                losses = got_r["trained_losses"]
                assert len(losses) == 10 and np.isfinite(losses).all() and losses.max() < 5
                if tables == "dynamic":
                    check_transformers(tmp_path, got_r, want, r, world)
            check_work_spread(tmp_path, tables, world)
        if tables == "full":
            check_a_corrupt_file_stops_every_rank(tmp_path, optimizer, tables)


def check_a_corrupt_file_stops_every_rank(out: Path, optimizer: str, tables: str) -> None:
    """The sha256 check is shared out (rank r of M checks every M-th file from the r-th): a
    file only rank 1 checks is corrupt, and every rank stops with its name, none left waiting."""
    at20 = out / "ck" / "step-00000020"
    victim = at20 / sorted(read_manifest(at20)["files"])[1]  # rank 1's of 2
    victim.write_bytes(victim.read_bytes()[:-1] + b"?")
    done = torchrun(2, WORKER, str(out), "resume", optimizer, tables, "", timeout=600)
    assert done.returncode != 0
    said = f"{victim}: sha256 differs from manifest.json"
    assert sum(said in line for line in done.stderr.splitlines() if "CheckpointError" in line) == 2, done.stderr[-6000:]


def check_transformers(out: Path, got, want: dict[str, np.ndarray], rank: int, world: int) -> None:
    """This rank's rebuilt transformers: IDs it owns under `world` that were resident on a
    rank of the 2-rank job, as many as fit (all, where they do), each slot holding its ID's
    row as the 2-rank job left it."""
    old = [torch.load(out / "ck" / "step-00000020" / f"rank-{r:05d}.pt", weights_only=False) for r in range(2)]
    for name, rows in want.items():
        ids = got[f"resident_ids_{name}"]
        assert len(ids), name
        owned = owner_of(torch.from_numpy(ids), world).numpy()
        assert (owned == rank).all(), f"table {name}: rank {rank} holds IDs it does not own"
        was = np.concatenate([o["transformers"][name]["ids"].numpy() for o in old])
        assert np.isin(ids, was).all()
        mine = was[owner_of(torch.from_numpy(was), world).numpy() == rank]
        assert len(ids) == min(len(mine), int(got[f"capacity_{name}"])), name
        np.testing.assert_array_equal(got[f"resident_rows_{name}"], rows[ids], err_msg=f"table {name}")


def check_work_spread(out: Path, tables: str, world: int) -> None:
    """Each piece of the checkpoint was read by one new rank: every old rank's file by exactly
    one; a dynamic table's every shard file (of each link of the chain) by exactly one, so on
    3 ranks no rank read (and pushed) all rows; a full table's old per-rank folder only by the
    new ranks whose block overlaps the old rank's."""
    work = [np.load(out / f"resume-{world}-rank{r}.npz") for r in range(world)]
    read = sorted(int(i) for w in work for i in w["work_rank_files"])
    assert read == [0, 1], f"old rank files read by the {world} new ranks: {read}"
    links = chain(out / "ck" / "step-00000020")
    rows = [int(w["work_rows_read"]) for w in work]
    if tables == "dynamic":
        shards = {
            f"{c.name}/{t.name}/{s.file}": s.rows
            for c in links
            for t in sorted((c / "tables").iterdir())
            for s in TableReader(t).manifest.shards
        }
        files = [str(f) for w in work for f in w["work_table_files"]]
        assert sorted(files) == sorted(shards), "each shard file read by exactly one rank"
        assert sum(rows) == sum(shards.values())
        stored = [int(w["work_rows_stored"]) for w in work]
        assert sum(stored) == sum(shards.values())  # each row written once (by its reader or owner)
        if world > 1:
            assert max(rows) < sum(shards.values()) and min(rows) > 0, rows
            assert max(stored) < sum(stored) and min(stored) > 0, stored
        return
    first = [np.load(out / f"first-2-rank{r}.npz") for r in range(2)]
    for name in {k[len("restored_start_") :] for k in work[0].files if k.startswith("restored_start_")}:
        starts = [int(f[f"first_start_{name}"]) for f in first]
        old = [(a, a + len(f[f"first_table_{name}"])) for a, f in zip(starts, first)]
        for w in work:
            lo = int(w[f"restored_start_{name}"])
            hi = lo + len(w[f"restored_table_{name}"])
            got = sorted(str(f).split("/")[-1] for f in w["work_table_files"] if str(f).split("/")[1] == name)
            overlap = [f"rank-{i:05d}" for i, (a, b) in enumerate(old) if a < hi and lo < b]
            assert got == sorted(overlap * len(links)), f"table {name}, block {lo}..{hi}: read {got}"


@pytest.mark.torchrec
def test_a_rebuilt_transformer_keeps_what_its_policy_keeps_first_and_sums_the_sketches():
    """More resident IDs than slots: the most recently used stay (LRU), in slots 0..n-1, the
    rest left out; the admission sketches' counters are summed, so an ID seen on two old ranks
    once each is admitted at its next sighting under admit_threshold 3."""
    from dynemb.checkpoint.checkpoint import rebuild_transformer
    from dynemb.idtransformer.admission import CountMinSketch
    from dynemb.idtransformer.policy import EvictionPolicy
    from dynemb.idtransformer.transformer import IDTransformer

    local = IDTransformer(4, EvictionPolicy("lru"), admit_threshold=3, sketch_width=64, sketch_depth=2)
    found = [  # (ids, last access, freq) of two old ranks
        (torch.tensor([10, 11, 12]), torch.tensor([5, 9, 1], dtype=torch.int32), torch.ones(3, dtype=torch.uint8)),
        (torch.tensor([20, 21, 22]), torch.tensor([8, 2, 7], dtype=torch.int32), torch.ones(3, dtype=torch.uint8)),
    ]
    sketches = []
    for _ in range(2):
        sketch = CountMinSketch(64, 2)
        sketch.add(torch.tensor([99]))
        sketches.append(sketch.state_dict()["counts"].to(torch.int64))
    assert rebuild_transformer(local, found, step=10, sketch=sketches[0] + sketches[1]) == 4
    state = local.state_dict()
    assert sorted(state["ids"].tolist()) == [10, 11, 20, 22]  # last access 5, 9, 8, 7: the newest four
    assert state["step"] == 10 and local.resident == 4 and state["slots"].tolist() == [0, 1, 2, 3]
    assert int(local.sketch.estimate(torch.tensor([99]))[0]) == 2
    got = local.transform(torch.tensor([11, 99]))
    assert got.slots[0] >= 0 and int(got.admitted_ids.numel()) == 1  # 11 resident; 99's third sighting admits it


@pytest.mark.torchrec
def test_the_data_resumes_at_the_global_sample_rounded_down_to_a_step():
    from dynemb.checkpoint.checkpoint import data_start

    doc = {"step": 20, "samples": 20 * 48 * 2, "world_size": 2, "config": {"batch_size": 48}}
    assert data_start(doc, 48, 2) == 20  # same world: the step
    assert data_start(doc, 48, 1) == 40  # exact
    assert data_start(doc, 48, 4) == 10
    assert data_start(doc, 48, 3) == 13  # 1920 // 144: 48 samples trained again
    assert data_start(doc, 96, 1) == 20  # another batch size: the same samples
    old = {k: v for k, v in doc.items() if k != "samples"}  # a manifest from before `samples`
    assert data_start(old, 48, 1) == 40
    resharded = dict(doc, step=30, samples=13 * 48 * 3 + 10 * 48 * 3)  # a 3-rank job's, 10 steps after
    assert data_start(resharded, 48, 3) == 23 and data_start(resharded, 48, 1) == 69


@pytest.mark.torchrec
def test_the_restore_work_is_shared_out_by_rows_the_same_on_every_rank():
    from dynemb.checkpoint.checkpoint import spread

    sizes = [1 << 20] * 7 + [500, 3, 1 << 19]
    takes = spread(sizes, 4)
    assert takes == spread(sizes, 4)  # the same everywhere: no message needed
    load = [sum(s for s, r in zip(sizes, takes) if r == rank) for rank in range(4)]
    assert max(load) - min(load) <= 1 << 20 and min(load) > 0
    assert spread([5, 5], 3) == [0, 1] and spread([], 3) == [] and spread([2, 9, 4], 1) == [0, 0, 0]


@pytest.mark.parametrize("rows,world", [(6000, 2), (6000, 3), (10, 4), (5, 4), (7, 1), (1001, 7)])
@pytest.mark.torchrec
def test_the_old_blocks_are_those_of_torchrec_row_wise_sharding(rows, world):
    """A full table's old per-rank folders are chosen by arithmetic on the old world size:
    it has to be the layout TorchRec gives."""
    from torchrec.distributed.sharding_plan import _calculate_rw_shard_sizes_and_offsets

    from dynemb.checkpoint.checkpoint import _row_block

    sizes, offsets = _calculate_rw_shard_sizes_and_offsets(rows, world, 8)
    for rank in range(world):
        first, end = _row_block(rows, world, rank)
        assert (first, end - first) == (offsets[rank][0], sizes[rank][0]), rank
