"""Dynamic tables behind a TorchRec EmbeddingCollection (sequence embeddings, no pooling):
the same exactness as for bags, on one process, with a small model of its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.ps_server.initializer import initial_rows
from dynemb.ps_server.schema import Initializer, TableSchema
from dynemb.tables.dynamic import DynamicTables, DynamicTableSpec
from dynemb.tables.row_store import LocalRowStore
from dynemb.tables.table_rows import find_tables
from dynemb.trainer.train import init_distributed

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

UNIVERSE, DIM, FEATURES = 500, 4, ["clicks", "views"]


class SequenceModel(nn.Module):
    """Sum of each feature's sequence of embeddings, then a linear head."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
                for f in FEATURES
            ],
            device=torch.device("meta"),
        )
        self.head = nn.Linear(DIM * len(FEATURES), 1)

    def forward(self, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        seqs = self.ec(kjt)
        pooled = []
        for f in FEATURES:
            jt = seqs[f]
            segment = torch.repeat_interleave(torch.arange(len(jt.lengths())), jt.lengths())
            pooled.append(torch.zeros(len(jt.lengths()), DIM).index_add_(0, segment, jt.values()))
        logits = self.head(torch.cat(pooled, dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def schema(f: str) -> TableSchema:
    return TableSchema(f"seq_{f}", DIM, state_width=DIM, initializer=Initializer("uniform", -0.5, 0.5, seed=3))


def run(dynamic: bool, table_order: list[str] = FEATURES) -> tuple[list[float], dict[str, np.ndarray]]:
    rows = 60 if dynamic else UNIVERSE
    torch.manual_seed(0)
    model = SequenceModel(rows)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ec.parameters(), {"lr": 0.2, "eps": 1e-8})
    constraints = {
        f"t_{f}": ParameterConstraints(
            sharding_types=[ShardingType.ROW_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for f in FEATURES
    }
    sharders = [EmbeddingCollectionSharder()]
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    ).collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = torch.optim.SGD([p for n, p in dmp.named_parameters() if "head" in n], lr=0.1)
    tables = find_tables(dmp)
    assert set(tables) == {"t_clicks", "t_views"}
    store = LocalRowStore()
    dyn = None
    if dynamic:
        # the dynamic tables in table_order: the batches' keys come in FEATURES' order, so
        # another order has their values sorted by table before the transform
        specs = [
            DynamicTableSpec(f"t_{f}", [f], schema(f), EvictionPolicy("lru", evict_fraction=0.2)) for f in table_order
        ]
        dyn = DynamicTables(tables, specs, store)
    else:
        for f in FEATURES:
            r = tables[f"t_{f}"]
            r.write(torch.arange(UNIVERSE), torch.from_numpy(initial_rows(schema(f), np.arange(UNIVERSE))))
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(60):
        lengths = torch.randint(0, 5, (2 * 16,), generator=gen)
        values = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * UNIVERSE).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
        labels = (torch.rand(16, generator=gen) < 0.5).float()
        if dyn is not None:
            kjt = dyn.transform(kjt)
        loss = dmp(kjt, labels)
        dense.zero_grad()
        loss.backward()
        dense.step()
        if dyn is not None:
            dyn.release_oldest()
        losses.append(float(loss))
    final = {}
    for f in FEATURES:
        if dyn is not None:
            dyn.flush()
            assert store.store.num_rows(schema(f).name) > 3 * rows  # rows went to the PS and came back
            final[f] = store.pull(schema(f).name, np.arange(UNIVERSE))
        else:
            final[f] = tables[f"t_{f}"].read(torch.arange(UNIVERSE)).numpy()
    return losses, final


@pytest.mark.parametrize("table_order", [FEATURES, FEATURES[::-1]], ids=["keys-in-table-order", "keys-out-of-order"])
def test_sequence_tables_train_exactly_like_full_ones(table_order):
    created = init_distributed()
    try:
        full_losses, full_rows = run(dynamic=False)
        dyn_losses, dyn_rows = run(dynamic=True, table_order=table_order)
    finally:
        if created:
            dist.destroy_process_group()
    assert np.abs(np.array(full_losses) - np.array(dyn_losses)).max() <= 1e-6
    for f in FEATURES:
        np.testing.assert_allclose(dyn_rows[f], full_rows[f], rtol=0, atol=1e-6, err_msg=f)
