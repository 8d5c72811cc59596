"""Checkpoint and restore of a training job: a job resumed from a checkpoint (full or the end
of an incremental chain, dynamic tables over a fresh PS or full tables) continues exactly as
the job that was not stopped; bad checkpoints are refused with the problem named."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TESTS, checkpointed_config, config, torchrun

from dynemb.checkpoint.format import MANIFEST, CheckpointError, checkpoints, read_manifest
from dynemb.trainer.train import train

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

STEPS = 40


def run(tmp: Path, optimizer: str, dynamic: bool, **extra):
    return train(config(optimizer, dynamic=dynamic, steps=STEPS, **extra), collect_tables=True)


def assert_same_tables(a, b):
    assert a.tables.keys() == b.tables.keys() and a.tables
    for name, (first, rows) in a.tables.items():
        assert b.tables[name][0] == first
        np.testing.assert_array_equal(b.tables[name][1], rows, err_msg=f"table {name}")


@pytest.mark.parametrize(
    "optimizer,dynamic,resume_at,pipeline",
    [
        ("adagrad", True, 20, True),  # incremental step 20 on full step 10
        ("adam", True, 30, True),  # a full one; Adam's moments and step count
        ("sgd", True, 20, False),  # the plain (unpipelined) loop
        ("rowwise_adagrad", False, 20, True),  # full tables, per-rank files, incremental
        ("adam", False, 30, True),
    ],
    ids=[
        "adagrad-dynamic-incremental",
        "adam-dynamic-full",
        "sgd-dynamic-plain",
        "rowwise-full-tables-incremental",
        "adam-full-tables",
    ],
)
@pytest.mark.slow
def test_a_resumed_job_continues_exactly(tmp_path, optimizer, dynamic, resume_at, pipeline):
    ck = tmp_path / "ck"
    first = run(
        tmp_path,
        optimizer,
        dynamic,
        pipeline=pipeline,
        checkpoint_dir=str(ck),
        checkpoint_every=10,
        checkpoint_full_every=2,
    )
    assert [c.name for c in checkpoints(ck)] == ["step-00000010", "step-00000020", "step-00000030"]
    kinds = [read_manifest(c)["kind"] for c in checkpoints(ck)]
    assert kinds == ["full", "incremental", "full"]
    # the resumed job starts a fresh PS: every row it has comes from the checkpoint. Same
    # checkpoint flags (another folder): its pipeline drains where the first job's did, so
    # the ID transformers see the same pins (the losses match either way; the hits need it)
    resumed = run(
        tmp_path,
        optimizer,
        dynamic,
        pipeline=pipeline,
        checkpoint_dir=str(tmp_path / "ck2"),
        checkpoint_every=10,
        resume=str(ck / f"step-{resume_at:08d}"),
    )
    assert len(resumed.losses) == STEPS - resume_at
    np.testing.assert_array_equal(resumed.losses, first.losses[resume_at:])
    assert resumed.auc == first.auc and resumed.logloss == first.logloss
    if dynamic:  # the ID transformers came back as they were: same hits, batch by batch
        assert len(resumed.hit_rates) == STEPS - resume_at
        np.testing.assert_array_equal(resumed.hit_rates, first.hit_rates[resume_at:])
        assert min(first.hit_rates) < 1.0
    assert_same_tables(first, resumed)


def test_checkpointing_does_not_change_training_and_latest_resumes(tmp_path):
    ck = tmp_path / "ck"
    plain = run(tmp_path, "adagrad", True)
    saved = run(tmp_path, "adagrad", True, checkpoint_dir=str(ck), checkpoint_every=15, checkpoint_at_end=True)
    np.testing.assert_array_equal(saved.losses, plain.losses)
    assert [c.name for c in checkpoints(ck)] == ["step-00000015", "step-00000030", "step-00000040"]
    # latest = step 40 = the end: nothing left to train, the same model evaluated
    again = run(tmp_path, "adagrad", True, checkpoint_dir=str(ck), resume="latest")
    assert again.losses == [] and again.auc == plain.auc
    assert_same_tables(plain, again)


def test_retention_keeps_the_newest_and_what_they_build_on(tmp_path):
    ck = tmp_path / "ck"
    run(tmp_path, "sgd", True, checkpoint_dir=str(ck), checkpoint_every=5, checkpoint_full_every=3, checkpoint_keep=2)
    # saved at 5 (full) 10 (inc) 15 (inc) 20 (full) 25 (inc) 30 (inc) 35 (full); keep 30, 35
    # and 30's chain (20, 25)
    assert [c.name for c in checkpoints(ck)] == [f"step-{s:08d}" for s in (20, 25, 30, 35)]
    assert read_manifest(ck / "step-00000030")["parent"] == "step-00000025"
    assert not list(ck.glob("*.partial"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One job's checkpoints (dynamic tables, adagrad): step 10 full, 20 incremental."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    train(checkpointed_config(ck))
    return ck


@pytest.fixture
def copy_of(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def resume_error(ck: Path, which: str, **extra) -> str:
    with pytest.raises(CheckpointError) as err:
        train(
            config(
                extra.pop("optimizer", "adagrad"),
                dynamic=extra.pop("dynamic", True),
                steps=30,
                checkpoint_dir=str(ck),
                resume=which,
                **extra,
            )
        )
    return str(err.value)


def test_a_corrupt_table_shard_is_named(copy_of):
    shard = sorted((copy_of / "step-00000010" / "tables" / "t_3").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    # resuming step 20 reads step 10 too (its base): the bad file there is found first
    msg = resume_error(copy_of, str(copy_of / "step-00000020"))
    assert str(shard) in msg and "sha256 differs" in msg


def test_a_missing_file_a_missing_parent_and_a_cut_manifest_are_named(copy_of):
    (copy_of / "step-00000020" / "rank-00000.pt").unlink()
    msg = resume_error(copy_of, "latest")
    assert "rank-00000.pt: listed in manifest.json but missing" in msg
    shutil.rmtree(copy_of / "step-00000010")
    msg = resume_error(copy_of, str(copy_of / "step-00000020"))
    assert "builds on step-00000010, which is not in" in msg
    (copy_of / "step-00000020" / MANIFEST).write_text('{"format": "dynemb.checkpoint", "vers')
    msg = resume_error(copy_of, str(copy_of / "step-00000020"))
    assert "manifest.json: not valid JSON" in msg
    msg = resume_error(copy_of, str(copy_of / "nowhere"))
    assert "no manifest.json" in msg


def test_a_checkpoint_of_another_job_is_refused(copy_of):
    latest = str(copy_of / "step-00000020")
    msg = resume_error(copy_of, latest, optimizer="sgd")
    assert "optimizer adagrad, this job's is sgd (resume with --optimizer adagrad," in msg  # the trainer's flag
    assert "dynamic tables, this job's are full" in resume_error(copy_of, latest, dynamic=False)
    doc = json.loads((copy_of / "step-00000020" / MANIFEST).read_text())
    doc["world_size"] = 4
    (copy_of / "step-00000020" / MANIFEST).write_text(json.dumps(doc))
    assert "written by 4 ranks, but it lists no rank-00001.pt" in resume_error(copy_of, latest)


def test_a_save_cut_off_before_its_rename_is_not_resumed_and_goes(copy_of):
    # every file and the manifest written, the rename to step-00000025 not made (the job's
    # workers stopped there by their elastic agent, say): not a complete checkpoint
    cut = copy_of / "step-00000025.partial"
    shutil.copytree(copy_of / "step-00000020", cut)
    doc = json.loads((cut / MANIFEST).read_text())
    (cut / MANIFEST).write_text(json.dumps(dict(doc, step=25)))
    assert [c.name for c in checkpoints(copy_of)] == ["step-00000010", "step-00000020"]
    cfg = dataclasses.replace(checkpointed_config(copy_of), steps=30, resume="auto")
    assert train(cfg).first_step == 20
    assert [c.name for c in checkpoints(copy_of)] == ["step-00000010", "step-00000020", "step-00000030"]
    assert not list(copy_of.glob("*.partial"))  # removed by the next save


def test_resume_latest_with_no_checkpoint_says_so(tmp_path):
    assert "no checkpoint in" in resume_error(tmp_path / "empty", "latest")


@pytest.mark.parametrize(
    "optimizer,tables,ps",
    [("adam", "dynamic", ""), ("sgd", "dynamic", "process"), ("rowwise_adagrad", "full", "")],
    ids=["dynamic-in-process", "dynamic-ps-process", "full"],
)
@pytest.mark.dist
def test_two_torchrun_ranks_resume_exactly(tmp_path, optimizer, tables, ps):
    """2 gloo ranks: each rank's losses, hit rates and block of every table after resuming from
    an incremental checkpoint equal the uninterrupted job's. Dynamic tables' rows in each
    rank's own store (rank 0 gathers them into the checkpoint; each rank takes back its own)
    or in a PS process both ranks share (the resumed job's restore replaces the rows the first
    job left there at step 40)."""
    from dynemb.testing.local_ps import LocalPS

    worker = TESTS / "dist" / "checkpoint_worker.py"
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(LocalPS()).address if ps else ""
        done = torchrun(2, worker, str(tmp_path), optimizer, tables, address, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    saved = checkpoints(tmp_path / "ck")
    assert [read_manifest(c)["world_size"] for c in saved] == [2, 2, 2]
    if tables == "full":  # each rank wrote its own block of every table
        assert sorted(p.name for p in (saved[0] / "tables" / "t_0").iterdir()) == ["rank-00000", "rank-00001"]
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert len(got["resumed_losses"]) == STEPS - 20
        np.testing.assert_array_equal(got["resumed_losses"], got["first_losses"][20:], err_msg=f"rank {rank}")
        np.testing.assert_array_equal(got["resumed_hit_rates"], got["first_hit_rates"][20:], err_msg=f"rank {rank}")
        assert got["resumed_auc"] == got["first_auc"]
        names = [k[len("first_table_") :] for k in got.files if k.startswith("first_table_")]
        assert len(names) == 6
        for name in names:
            assert got[f"resumed_first_{name}"] == got[f"first_first_{name}"]
            np.testing.assert_array_equal(
                got[f"resumed_table_{name}"], got[f"first_table_{name}"], err_msg=f"rank {rank} table {name}"
            )


@pytest.mark.dist
@pytest.mark.parametrize("fault", ["write", "read"])
def test_a_rank_that_cannot_save_its_share_fails_every_rank_alike(tmp_path, fault):
    """2 ranks, rows in each rank's store. write: rank 0 fails writing a table while rank 1
    still sends it that table's rows; read: rank 1 cannot read its rows. Either way the ranks
    go through every round together (no rank is left waiting, their collectives stay paired),
    both raise the same CheckpointError naming the rank and the cause, and no half-written
    folder stays."""
    worker = TESTS / "dist" / "checkpoint_fail_worker.py"
    done = torchrun(2, worker, str(tmp_path), fault, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert said[0] == said[1], said
    assert said[0].startswith("CheckpointError: checkpoint at step 10 could not be written ("), said[0]
    if fault == "write":
        assert "(rank 0: " in said[0] and "No space left on device" in said[0]
    else:
        assert "rank 1: RuntimeError: the store is gone" in said[0]
    assert said[0].endswith("\nrank 0 after the failed save; rank 1 after the failed save"), said[0]
    assert not (tmp_path / "ck").exists() or list((tmp_path / "ck").iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_fails_the_save_clearly_and_keeps_the_last_checkpoint(tmp_path):
    """A file-size limit (RLIMIT_FSIZE: writes fail with EFBIG, as on a full disk) that the
    step-10 checkpoint fits under and the step-20 one does not."""
    import resource
    import subprocess
    import sys

    from dynemb.checkpoint.format import verify
    from dynemb.testing.local_ps import REPO

    flags = [
        *(
            "--steps 30 --num-sparse 6 --universe 6000 --ids-per-feature 2 --dim 8 "
            "--capacity-fraction 0.1 --evict-fraction 0.1 --batch-size 48 "
            "--dense-arch 16,8 --over-arch 16,1 --eval-batches 2 --optimizer adagrad "
            "--no-progress --checkpoint-every 10"
        ).split(),
    ]

    def dynemb_train(ck: Path, *extra: str, limit: int | None = None) -> subprocess.CompletedProcess:
        def cap() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        return subprocess.run(
            [sys.executable, "-m", "dynemb.cli", "train", *flags, "--checkpoint-dir", str(ck), *extra],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            preexec_fn=cap,
        )

    def biggest(folder: Path) -> int:
        return max(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    probe = tmp_path / "probe"
    done = dynemb_train(probe, "--result-json", str(tmp_path / "probe.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    small, large = biggest(probe / "step-00000010"), biggest(probe / "step-00000020")
    assert small < large

    ck = tmp_path / "ck"
    done = dynemb_train(ck, limit=(small + large) // 2)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("dynemb: error: checkpoint at step 20 could not be written (rank 0: "), last
    assert "File too large" in last and f"the last one, {ck / 'step-00000010'}, is intact" in last
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000010"]  # no half-written folder
    verify(ck / "step-00000010")

    done = dynemb_train(ck, "--resume", "latest", "--result-json", str(tmp_path / "resumed.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads((tmp_path / "probe.json").read_text())["losses"][10:]
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == want


def test_the_checkpoint_package_imports_no_trainer():
    """dynemb.checkpoint sits below the DLRM job (dynemb.trainer): it may not import it."""
    import subprocess
    import sys

    from dynemb.testing.local_ps import REPO

    code = (
        "import sys, dynemb.checkpoint.checkpoint, dynemb.checkpoint.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('dynemb.trainer')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_settings_are_checked_and_a_mismatch_names_the_hint(tmp_path):
    from dynemb.checkpoint.checkpoint import CheckpointSettings, CheckpointTable, check_fits
    from dynemb.ps_server.schema import TableSchema

    with pytest.raises(ValueError, match="batch_size, keep and full_every must be >= 1"):
        CheckpointSettings(batch_size=8, full_every=0)
    with pytest.raises(ValueError, match="features must be a tuple"):
        CheckpointTable("t", TableSchema("t", 4), "f_0")
    assert CheckpointSettings(batch_size=8).manifest_config() == {"batch_size": 8}
    schema = TableSchema("t", 4)
    doc = {"config": {}, "world_size": 1, "files": {"rank-00000.pt": ""}, "dynamic": False, "optimizer": "sgd"}
    doc["tables"] = {"t": schema.to_dict()}
    check_fits(tmp_path, doc, {"t": schema}, 2, optimizer="sgd", dynamic=False)
    with pytest.raises(CheckpointError, match=r"optimizer sgd, this job's is adam \(restore it with optimizer sgd"):
        check_fits(tmp_path, doc, {"t": schema}, 1, optimizer="adam", dynamic=False)
    with pytest.raises(CheckpointError, match=r"\(use sgd\)$"):
        check_fits(tmp_path, doc, {"t": schema}, 1, optimizer="adam", dynamic=False, optimizer_hint="use {optimizer}")


def test_any_torchrec_model_with_a_plain_torch_optimizer_restores_exactly(tmp_path, one_process_group):
    """Not the DLRM job: a model of its own (a table two features share, one of one feature,
    a linear head), its dense layers under torch.optim.Adam (not a KeyedOptimizer), full
    tables. An incremental chain (full at step 2, the rows touched since at 4) restored after
    two more steps gives back step 4's tables, dense parameters and optimizer state."""
    from types import SimpleNamespace

    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from dynemb.checkpoint.checkpoint import Checkpointer, CheckpointSettings, CheckpointTable
    from dynemb.ps_server.schema import TableSchema, optimizer_state_width
    from dynemb.tables.dense import dense_parameters
    from dynemb.tables.table_rows import find_tables

    dim = 4
    configs = [
        EmbeddingBagConfig(name="users", embedding_dim=dim, num_embeddings=60, feature_names=["user", "friend"]),
        EmbeddingBagConfig(name="products", embedding_dim=dim, num_embeddings=30, feature_names=["item"]),
    ]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
            self.head = nn.Linear(3 * dim, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.head(self.ebc(kjt).values()).squeeze(1)

    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1, "eps": 1e-8})
    constraints = {
        c.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for c in configs
    }
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.plan(model, sharders)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = torch.optim.Adam(dense_parameters(dmp).values(), lr=0.01)
    rng = np.random.default_rng(0)

    def step(batch) -> None:
        dmp(batch.sparse_features).square().mean().backward()  # the tables step in backward
        dense.step()
        dense.zero_grad()

    def batches(n: int):
        for _ in range(n):  # 8 samples, one ID each; friends' IDs (40..59) no user has
            ids = [rng.integers(0, 40, 8), rng.integers(40, 60, 8), rng.integers(0, 30, 8)]
            kjt = KeyedJaggedTensor.from_lengths_sync(
                ["user", "friend", "item"], torch.from_numpy(np.concatenate(ids)), torch.ones(24, dtype=torch.int64)
            )
            yield SimpleNamespace(sparse_features=kjt)

    def state() -> tuple[dict, dict, dict]:
        rows = {n: r.read(torch.arange(r.local_rows)).clone() for n, r in find_tables(dmp).items()}
        params = {k: p.detach().clone() for k, p in dense_parameters(dmp).items()}
        moments = {k: v["exp_avg"].clone() for k, v in dense.state_dict()["state"].items()}
        return rows, params, moments

    width = optimizer_state_width("adagrad", dim)
    tables = [
        CheckpointTable("users", TableSchema("my_users", dim, width), ("user", "friend")),
        CheckpointTable("products", TableSchema("my_products", dim, width), ("item",)),
    ]
    settings = CheckpointSettings(batch_size=8, directory=tmp_path / "ck", full_every=2, progress=False)
    ckpt = Checkpointer(settings, dmp, tables, dense, optimizer="adagrad")  # full tables: no row store
    for k, batch in enumerate(ckpt.tap(batches(4)), start=1):
        step(batch)
        if k % 2 == 0:
            ckpt.save(k)
    at4 = state()
    doc = read_manifest(tmp_path / "ck" / "step-00000004")
    assert (doc["kind"], doc["parent"], doc["config"], doc["samples"]) == (
        "incremental",
        "step-00000002",
        {"batch_size": 8},
        32,
    )
    assert doc["optimizer"] == "adagrad" and not doc["dynamic"] and sorted(doc["tables"]) == ["products", "users"]
    for batch in batches(2):  # on past it: every part changes
        step(batch)
    now = state()
    assert sorted(now[0]) == ["products", "users"] and len(now[1]) == 2 and len(now[2]) == 2
    for part, want_part in zip(now, at4):
        assert all(not torch.equal(part[k], want_part[k]) for k in part), "every part changes"
    assert not torch.equal(now[0]["users"][40:], at4[0]["users"][40:])  # rows only friends' IDs touch

    again = Checkpointer(settings, dmp, tables, dense, optimizer="adagrad")
    assert again.restore("latest") == 4 and again.data_start == 4
    got = state()
    for want_part, got_part in zip(at4, got):
        assert want_part.keys() == got_part.keys()
        for key in want_part:
            torch.testing.assert_close(got_part[key], want_part[key], rtol=0, atol=0, msg=str(key))
    with pytest.raises(CheckpointError, match=r"optimizer adagrad, this job's is sgd"):
        Checkpointer(settings, dmp, tables, dense, optimizer="sgd").restore("latest")


def test_a_save_while_a_thread_transforms_ahead_is_refused_in_one_line(tmp_path, one_process_group):
    """A transform thread moves rows while they would be saved: the save says how to avoid it."""
    import sys

    sys.path.insert(0, str(TESTS / "tables"))
    from tables_models import CONFIGS, batches, build, train_step

    from dynemb import tables as dt
    from dynemb.checkpoint import Checkpointer, CheckpointError, CheckpointSettings

    model, dense = build(60)
    with dt.DynamicEmbeddings(model, CONFIGS) as dyn:
        ckpt = Checkpointer.of(dyn, dense, CheckpointSettings(batch_size=16, directory=str(tmp_path)))
        for step, (kjt, y) in enumerate(dyn.wrap(batches(6), prefetch=1), start=1):
            train_step(model, dense, kjt, y)
            if step == 3:
                with pytest.raises(CheckpointError, match=r"step 3: a thread is transforming .* prefetch=0"):
                    ckpt.save(step)
        assert ckpt.save(6).name == "step-00000006"  # between wraps: saved
