"""A small own model for the public API's tests: two EmbeddingBagCollection tables and a head,
trained on seeded batches of (KJT, labels), with dynamic tables or with full ones (one row per
ID of a small universe, each started as the dynamic table's PS would hand it out)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from dynemb import tables as dt

UNIVERSE, DIM, FEATURES, TABLES = 400, 4, ["user_id", "item_id"], ["user", "item"]
CONFIGS = [dt.TableConfig("user", policy="lru", evict_fraction=0.2), dt.TableConfig("item", policy="hybrid")]


class Tiny(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
                for t, f in zip(TABLES, FEATURES)
            ],
            device=torch.device("meta"),
        )
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt).values()).squeeze(1)


def build(rows: int, optimizer=RowWiseAdagrad, configs=CONFIGS, device: str = "cpu"):
    """(DMP model on `device`, dense optimizer); a full model (rows == UNIVERSE) has every row
    started as the dynamic table's store starts a never-seen ID."""
    torch.manual_seed(0)
    model = Tiny(rows)
    apply_optimizer_in_backward(optimizer, model.ebc.parameters(), {"lr": 0.1})
    dmp = dt.shard_model(model, configs, device)
    dense = torch.optim.SGD(dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), lr=0.1)
    if rows == UNIVERSE:
        dt.start_full_tables(dmp, configs)
    return dmp, dense


def batches(n: int, seed: int = 5, batch_size: int = 16):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        lengths = torch.randint(0, 4, (2 * batch_size,), generator=gen)
        values = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * UNIVERSE).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
        yield kjt, (torch.rand(batch_size, generator=gen) < 0.5).float()


def train_step(model, dense, kjt, labels, device: str = "cpu") -> float:
    loss = nn.functional.binary_cross_entropy_with_logits(model(kjt.to(device)), labels.to(device))
    dense.zero_grad()
    loss.backward()
    dense.step()
    return float(loss)


def full_rows(model) -> dict[str, np.ndarray]:
    from dynemb.tables.table_rows import find_tables

    return {n: r.read(torch.arange(r.local_rows)).cpu().numpy() for n, r in find_tables(model).items()}
