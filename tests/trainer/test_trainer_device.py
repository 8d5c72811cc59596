"""--device, the row moves between the tables and the host, and the plain model: on the CPU
here, and on a GPU where there is one (the tests marked so are skipped without)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import config

from dynemb.tables.device import DeviceUnavailable, resolve_device

needs_gpu = pytest.mark.cuda  # skipped without a GPU (conftest); `pytest -m cuda` selects it
FLAGS = (
    "--steps 4 --num-sparse 3 --universe 1000 --capacity-fraction 0.5 --dim 8 --dense-arch 16,8 --over-arch 16,1 "
    "--batch-size 16 --eval-batches 1 --log-every 2 --no-progress"
).split()


def test_cpu_and_auto_without_a_gpu_are_the_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_one_line(tmp_path):
    with pytest.raises(DeviceUnavailable, match=r"--device cuda: no CUDA GPU is visible .*use --device cpu or auto"):
        resolve_device("cuda")
    run = subprocess.run(
        [sys.executable, "-m", "dynemb.trainer", *FLAGS, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert (
        [line for line in run.stderr.splitlines() if "error" in line]
        == [line for line in run.stderr.splitlines() if line.startswith("dynemb: error: --device cuda: no CUDA GPU")]
        != []
    ), run.stderr[-3000:]
    assert "Traceback" not in run.stderr


def test_more_local_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(DeviceUnavailable, match=r"2 ranks on this machine but 1 GPU: one rank per GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        config("sgd", dynamic=True, device="tpu")


def _tables(device: str = "cpu"):
    """Two tables of one width with Adagrad-like state, rows numbered by value."""
    from dynemb.tables.row_group import RowGroup
    from dynemb.tables.table_rows import TableRows

    tables = []
    for t in range(2):
        w = torch.arange(40, dtype=torch.float32, device=device).view(10, 4) + 100 * t
        s = -w.clone()
        tables.append(TableRows(f"t{t}", w, [s], 10 * t))  # row-wise: table t's block starts at 10 t
    return tables, RowGroup(tables)


def _check_moves(device: str, no_syncs=contextlib.nullcontext) -> None:
    """Read 3 rows out of 2 tables and write others in; `no_syncs`: what the moves run under."""
    from dynemb.tables.row_moves import RowMoves

    tables, group = _tables(device)
    moves = RowMoves(group, device)
    slots = torch.tensor([2, 5, 13], device=device)  # 2 rows of t0, 1 of t1 (at its offset 10)
    new = [np.full((2, 8), 7.0, np.float32), np.full((1, 8), 9.0, np.float32)]
    with no_syncs():
        moves.released()
        rows, held = moves.read_out(slots, [2, 1])
        expected = [r.copy() for r in rows]
        moves.give_back(held)
        moves.write_in(slots, [2, 1], new)
        moves.wait()
    assert [r.shape for r in expected] == [(2, 8), (1, 8)]
    np.testing.assert_array_equal(expected[0][:, :4], np.arange(40, dtype=np.float32).reshape(10, 4)[[2, 5]])
    np.testing.assert_array_equal(expected[1][:, 4:], -(np.arange(40, dtype=np.float32).reshape(10, 4)[[3]] + 100))
    assert float(tables[0].weights[5, 0]) == 7.0 and float(tables[0].states[0][2, 3]) == 7.0
    assert float(tables[1].weights[3, 1]) == 9.0 and float(tables[1].weights[4, 1]) == 117.0  # others untouched
    assert float(tables[0].weights[0, 0]) == 0.0


def test_row_moves_on_the_cpu_are_the_row_groups_reads_and_writes():
    from dynemb.tables.row_moves import RowMoves

    _check_moves("cpu")
    _, group = _tables()
    moves = RowMoves(group)
    assert not moves.cuda and moves.rows_in is None
    with moves.thread_stream():  # nothing to set up on the CPU
        moves.wait()


@needs_gpu
def test_row_moves_on_a_gpu_use_events_not_device_syncs():
    from dynemb.tables.row_moves import RowMoves

    @contextlib.contextmanager
    def no_syncs():
        torch.cuda.set_sync_debug_mode("error")  # a device-wide or stream sync raises
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    _check_moves("cuda", no_syncs)
    tables, group = _tables("cuda")
    moves = RowMoves(group, "cuda")
    for n in (3, 3, 5):  # reused, not made again each time
        rows, held = moves.read_out(torch.arange(n, device="cuda"), [n, 0])
        moves.give_back(held)
    assert moves._pool.allocated == 1


@pytest.mark.slow
@pytest.mark.torchrec
def test_cpu_and_auto_train_alike():
    from dynemb.trainer.train import train

    cpu = train(config("adagrad", dynamic=True, steps=12, device="cpu"))
    auto = train(config("adagrad", dynamic=True, steps=12, device="auto"))
    assert len(cpu.losses) == 12 and cpu.losses == auto.losses


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.torchrec
def test_the_plain_model_trains_exactly_like_its_full_tables(optimizer):
    """torch EmbeddingBags (no fbgemm-gpu): dynamic tables at 10% of the IDs, rows in the
    embedded store, against the same model holding every ID."""
    from dynemb.trainer.train import train

    full = train(config(optimizer, dynamic=False, model="plain", steps=40))
    dyn = train(config(optimizer, dynamic=True, model="plain", steps=40))
    assert len(full.losses) == len(dyn.losses) == 40
    diff = np.abs(np.array(full.losses) - np.array(dyn.losses))
    assert diff.max() <= 1e-6, f"losses part at step {int(diff.argmax())}: {diff.max():.3g}"
    assert full.losses[0] != full.losses[-1] and dyn.hit_rate < 1.0  # trained, and rows did move
    assert abs(full.auc - dyn.auc) <= 1e-6 and abs(full.logloss - dyn.logloss) <= 1e-6


@pytest.mark.slow
def test_without_torchrec_the_job_trains_the_plain_model():
    """TorchRec and fbgemm-gpu made unimportable: the job says so once and trains the plain model;
    a setting the plain model lacks is one line naming it."""
    code = (
        "import sys; sys.modules['torchrec'] = None; sys.modules['fbgemm_gpu'] = None\n"
        "from dynemb.trainer.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", code, *FLAGS, "--optimizer", "adagrad"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TorchRec did not load" in run.stderr and "training the plain model" in run.stderr
    assert run.stdout.startswith("steps 4  final loss")
    refused = subprocess.run(
        [sys.executable, "-c", code, *FLAGS, "--optimizer", "adam"], capture_output=True, text=True, env=env
    )
    assert refused.returncode == 1
    assert "dynemb: error: the plain model (--model plain, no fbgemm-gpu) has no --optimizer adam" in refused.stderr


@needs_gpu
@pytest.mark.slow
@pytest.mark.torchrec
def test_one_gpu_trains_like_the_cpu():
    """TorchRec's DLRM on one GPU (NCCL, a group of one): the dynamic tables train as on the
    CPU (FBGEMM's GPU kernels sum in another order: close, not equal), and evaluation's
    missing rows come back over NCCL."""
    from dynemb.trainer.train import train

    gpu = train(config("rowwise_adagrad", dynamic=True, steps=30, device="cuda"))
    cpu = train(config("rowwise_adagrad", dynamic=True, steps=30, device="cpu"))
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=0, atol=1e-3)
    assert gpu.hit_rate == cpu.hit_rate and abs(gpu.auc - cpu.auc) < 1e-2


@needs_gpu
def test_nccl_collectives_with_one_rank():
    """The trainer's collectives on an NCCL group of one: device tensors in and out."""
    import torch.distributed as dist

    from dynemb.tables.device import collective_device, control_group, init_distributed
    from dynemb.trainer.collectives import all_gather_ragged

    device = resolve_device("cuda")
    assert init_distributed(device)
    try:
        assert dist.get_backend() == "nccl" and control_group() is not None
        assert collective_device().type == "cuda"
        got = all_gather_ragged(torch.arange(6.0, device=device).view(2, 3))
        assert len(got) == 1 and got[0].is_cuda and got[0].tolist() == [[0, 1, 2], [3, 4, 5]]
        dist.monitored_barrier(group=control_group())
    finally:
        dist.destroy_process_group()


@pytest.mark.torchrec
def test_pinning_a_batch_leaves_a_kjt_already_on_the_device(monkeypatch):
    """On a GPU the job pins each batch before its copy; the KJT of a batch that dynamic tables
    transformed is on the device already, and pinning it would fail ("cannot pin
    'torch.cuda.LongTensor'", seen on an H100). Pinning is faked here: this CPU cannot pin."""
    from dynemb.tables.jagged import Batch, KeyedJaggedTensor
    from dynemb.trainer.train import pinned

    calls = []

    def fake_pin(self):
        if self.device.type != "cpu":
            raise RuntimeError(f"cannot pin a tensor on {self.device}")
        calls.append(self.shape)
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)

    def batch(device: str) -> Batch:
        kjt = KeyedJaggedTensor(["f"], torch.arange(4, device=device), torch.tensor([2, 2], device=device))
        return Batch(torch.ones(2, 3), kjt, torch.zeros(2))

    on_host = pinned(batch("cpu"))
    assert len(calls) == 4  # dense, labels, the KJT's values and lengths
    calls.clear()
    moved = batch("meta")
    out = pinned(moved)
    assert out.sparse_features is moved.sparse_features
    assert len(calls) == 2
    assert torch.equal(on_host.dense_features, torch.ones(2, 3))
