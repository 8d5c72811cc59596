"""Which thread drives which process group (docs/design.md, "Communicators and threads"), on 2
torchrun ranks set up as a NCCL job is: a gloo control group beside the default group. The
training thread and the transform thread never share a group, nor are two threads ever inside
one group's collectives at once; a loop left early on every rank, one rank's transform thread
seeing the stop at once and the other's not, leaves no exchange half-done; checkpoint save,
restore and table export call collectives over the control group alone (on a NCCL job the
default group is NCCL's, which takes GPU tensors and is the training loop's), and the restored
job trains on exactly as the saved one did."""

from __future__ import annotations

import json

import pytest
from helpers import TESTS, torchrun

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

WORKER = TESTS / "dist" / "communicators_worker.py"


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> tuple[str, list[dict]]:
    """The worker's output (its end) and what each rank wrote, however far it got."""
    out = tmp_path_factory.mktemp("communicators")
    done = torchrun(2, WORKER, str(out), timeout=200)
    said = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").exists()]
    output = f"exit status {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
    return ("" if done.returncode == 0 else output), said


@pytest.mark.dist
def test_each_group_is_driven_by_one_kind_of_thread_one_thread_at_a_time(worker):
    failed, ranks = worker
    assert len(ranks) == 2, failed
    for rank, got in enumerate(ranks):
        assert got["overlaps"] == [], (rank, got["overlaps"][:5])
        uses = got["uses"]
        assert uses.get("transform") == ["dynemb-transform"], (rank, uses)  # the IDs' exchanges, batch by batch
        assert uses.get("tables") == ["main"], (rank, uses)  # look-ups, hit rates
        assert uses.get("default") == ["main"] and uses.get("control") == ["main"], (rank, uses)
        assert set(uses) == {"default", "control", "tables", "transform"}, (rank, uses)
        # past the loop left early: every rank's transform thread stopped after the same exchange
        assert got["phases"][:3] == ["train", "evaluate", "break"], (rank, got["phases"], failed)


@pytest.mark.dist
def test_checkpoint_restore_and_export_use_the_control_group_alone(worker):
    failed, ranks = worker
    assert len(ranks) == 2, failed
    for rank, got in enumerate(ranks):
        assert got["violations"] == [], (rank, got["violations"][:5])
        assert got["phases"] == ["train", "evaluate", "break", "checkpoint"], (rank, got["phases"], failed)
        assert got["restored_step"] == 8
        assert len(got["losses_on"]) == 3 and got["losses_again"] == got["losses_on"], rank
    assert ranks[1]["exported_rows"] == {}
    assert sorted(ranks[0]["exported_rows"]) == ["item", "user"]
    assert all(n > 0 for n in ranks[0]["exported_rows"].values())
    assert not failed, failed


def test_what_would_read_or_replace_rows_under_a_transform_thread_is_refused(tmp_path, one_process_group):
    """flush, export_tables and restore (save has its own test) while a thread transforms
    ahead: refused, saying what to do; between wraps they run."""
    import sys

    sys.path.insert(0, str(TESTS / "tables"))
    from tables_models import CONFIGS, batches, build, train_step

    from dynemb import tables as dt
    from dynemb.checkpoint import Checkpointer, CheckpointError, CheckpointSettings, export_tables

    model, dense = build(60)
    with dt.DynamicEmbeddings(model, CONFIGS) as dyn:
        ckpt = Checkpointer.of(dyn, dense, CheckpointSettings(batch_size=16, directory=str(tmp_path / "ck")))
        ckpt.save(0)
        for step, (kjt, y) in enumerate(dyn.wrap(batches(4), prefetch=1), start=1):
            train_step(model, dense, kjt, y)
            if step == 2:
                with pytest.raises(dt.SetupError, match=r"^flush\(\) while a thread transforms .* prefetch=0$"):
                    dyn.flush()
                with pytest.raises(dt.SetupError, match=r"^flush\(\) while a thread transforms"):
                    export_tables(dyn, tmp_path / "export", progress=False)
                with pytest.raises(
                    CheckpointError, match=r"^restore latest: a thread is transforming .* between wraps$"
                ):
                    ckpt.restore("latest")
        assert dyn.flush() > 0
        assert sorted(export_tables(dyn, tmp_path / "export", progress=False)) == ["item", "user"]
        assert ckpt.restore("latest") == 0
