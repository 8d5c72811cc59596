"""Evaluation looks rows up without training them: a held-out ID is neither admitted nor pushed,
and reads its row where it lies (the device, the PS, or its initial value)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import config
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.ps_server.initializer import initial_rows
from dynemb.tables.metrics import TrainerMetrics
from dynemb.tables.row_store import LocalRowStore
from dynemb.trainer.data import SyntheticCriteo
from dynemb.trainer.model import build
from dynemb.trainer.train import make_dynamic

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here


def _state(dynamic) -> dict[str, torch.Tensor]:
    return {n: t.local.records.clone() for n, t in dynamic.transformers.items()}


@pytest.mark.usefixtures("one_process_group")
def test_look_up_reads_rows_where_they_lie_and_changes_nothing():
    cfg = config("adagrad", dynamic=True)
    built = build(cfg)
    store = LocalRowStore()
    dynamic = make_dynamic(cfg, built, store, TrainerMetrics(0)).tables  # the engine under the public API
    for _ in dynamic.wrap(SyntheticCriteo(cfg.data, cfg.batch_size).train_batches(), ahead=0):
        dynamic.release_oldest()
        if dynamic.transformers["t_0"].local.step == 3:
            break
    t0 = dynamic.transformers["t_0"].local
    resident = t0.slot_id[t0.last_access != -1][:2]
    schema = built.schemas["t_0"]
    on_ps = np.array([10**12, 10**12 + 1])  # rows the PS holds, never resident
    ps_rows = np.arange(2 * (schema.dim + schema.state_width), dtype=np.float32).reshape(2, -1)
    store.push(schema.name, on_ps, ps_rows)
    unseen = np.array([-(10**15), 7 * 10**14])
    before, records = {n: [ids for ids, _ in store.export(n)] for n in dynamic.ps_names}, _state(dynamic)
    steps = {n: t.local.step for n, t in dynamic.transformers.items()}

    # sample 0: a resident ID and a PS row; sample 1: the other resident ID, the other PS row and
    # both unseen IDs; every other feature (t_1 ...) empty
    values = torch.tensor([int(resident[0]), int(on_ps[0]), int(resident[1]), int(on_ps[1]), *unseen.tolist()])
    lengths = torch.tensor([2, 4] + [0] * 2 * (len(built.features) - 1), dtype=torch.int32)
    kjt = KeyedJaggedTensor(keys=built.features, values=values, lengths=lengths)
    looked = dynamic.look_up(kjt)

    assert looked.kjt.lengths().tolist()[:2] == [1, 1]  # only the resident IDs go to the device
    assert looked.kjt.values().tolist() == [int(t0.map.find(resident[:1])), int(t0.map.find(resident[1:]))]
    dim = schema.dim
    want = np.stack([ps_rows[0, :dim], ps_rows[1, :dim] + initial_rows(schema, unseen)[:, :dim].sum(0)])
    np.testing.assert_allclose(looked.missing[built.features[0]].numpy(), want, rtol=1e-6)
    assert not looked.missing[built.features[1]].any()
    # nothing changed: no records, clocks or counters, no rows on the store
    for name, t in dynamic.transformers.items():
        assert torch.equal(t.local.records, records[name]) and t.local.step == steps[name], name
    after = {n: [ids for ids, _ in store.export(n)] for n in dynamic.ps_names}
    assert {n: np.concatenate(v or [np.zeros(0, np.int64)]).tolist() for n, v in before.items()} == {
        n: np.concatenate(v or [np.zeros(0, np.int64)]).tolist() for n, v in after.items()
    }


@pytest.mark.dist
def test_two_ranks_evaluate_without_leaving_rows_on_the_ps(tmp_path):
    """2 torchrun ranks over a PS process: after training and evaluation, the PS holds rows of
    trained IDs only, though the held-out batches had IDs training never saw."""
    from dynemb.ps_server.client import PSClient
    from dynemb.testing.local_ps import LocalPS
    from dynemb.trainer.config import DataConfig

    steps, batch, universe = 6, 32, 20_000
    data = DataConfig(num_sparse=2, universe=universe, zipf=1.05)
    with LocalPS() as ps:
        run = subprocess.run(
            [
                sys.executable,
                *"-m torch.distributed.run --standalone --nproc_per_node=2 -m dynemb.trainer".split(),
                *f"--ps {ps.address} --steps {steps} --batch-size {batch} --eval-batches 4".split(),
                *f"--num-sparse 2 --universe {universe} --zipf 1.05 --dim 8 --dense-arch 8".split(),
                *"--over-arch 8,1 --capacity-fraction 0.01 --no-progress".split(),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-4000:]
        with PSClient([ps.address]) as client:
            on_ps = {t: np.concatenate([ids for ids, _ in client.export(f"dynemb_t_{t}")]) for t in range(2)}
    for t in range(2):
        trained, held_out = set(), set()
        for rank in range(2):
            source = SyntheticCriteo(data, batch, rank, 2)
            for k in range(steps + 3):  # the ones a pipeline fetched beyond the last step too
                trained.update(source.batch(k).sparse_features[f"cat_{t}"].values().tolist())
            for k in range(4):
                held_out.update(source.batch(k, split=1).sparse_features[f"cat_{t}"].values().tolist())
        assert held_out - trained, "the test needs held-out IDs that training never saw"
        assert set(on_ps[t].tolist()) <= trained, f"table {t}: rows of held-out IDs reached the PS"
        assert len(on_ps[t]) > 0
