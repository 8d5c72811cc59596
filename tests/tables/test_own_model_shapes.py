"""What an own model may have beyond the examples (docs/library.md, "What works"): one table read
by two features, tables of different dims in one collection, per-ID weights; with dynamic tables
it trains exactly like full tables started by start_full_tables, and where admission leaves IDs
out of their bags their weights go with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from dynemb import tables as dt

pytestmark = [pytest.mark.torchrec, pytest.mark.usefixtures("one_process_group")]

UNIVERSE, CAPACITY = 300, 48
FEATURES = ["item_id", "history", "user_id"]  # item_id and history read one table, "item"
CONFIGS = [dt.TableConfig("item", policy="lru"), dt.TableConfig("user", policy="hybrid")]


class Shapes(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="item", embedding_dim=4, num_embeddings=rows, feature_names=FEATURES[:2]),
                EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=rows, feature_names=FEATURES[2:]),
            ],
            is_weighted=True,
            device=torch.device("meta"),
        )
        self.head = nn.Linear(4 + 4 + 8, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt).values()).squeeze(1)


def build(rows: int):
    torch.manual_seed(0)
    model = Shapes(rows)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})
    dmp = dt.shard_model(model, CONFIGS)
    dense = torch.optim.SGD(dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), lr=0.1)
    if rows == UNIVERSE:
        dt.start_full_tables(dmp, CONFIGS)
    return dmp, dense


def batches(n: int, size: int = 10):
    gen = torch.Generator().manual_seed(3)
    for _ in range(n):
        lengths = torch.cat([torch.ones(size, dtype=torch.long), torch.randint(1, 6, (size,), generator=gen)])
        lengths = torch.cat([lengths, torch.randint(0, 3, (size,), generator=gen)])
        n_values = int(lengths.sum())
        values = (torch.rand(n_values, generator=gen) ** 2 * UNIVERSE).long()
        weights = torch.rand(n_values, generator=gen) + 0.5
        kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths, weights=weights)
        yield kjt, (torch.rand(size, generator=gen) < 0.5).float()


def step(model, dense, kjt, labels) -> float:
    loss = nn.functional.binary_cross_entropy_with_logits(model(kjt), labels)
    dense.zero_grad()
    loss.backward()
    dense.step()
    return float(loss)


def test_a_shared_table_mixed_dims_and_weights_train_exactly_like_full_tables():
    full, full_dense = build(UNIVERSE)
    want = [step(full, full_dense, kjt, y) for kjt, y in batches(16)]
    model, dense = build(CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS, table_prefix="shapes_") as dyn:
        got = [step(model, dense, kjt, y) for kjt, y in dyn.wrap(batches(16))]
        assert len(dyn.tables.transformers) == 2  # one transformer for the shared table
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)


def test_ids_left_out_of_their_bags_take_their_weights_with_them():
    model, _ = build(CAPACITY)
    configs = [CONFIGS[0].__class__("item", policy="lru", admit_threshold=2), CONFIGS[1]]
    with dt.DynamicEmbeddings(model, configs, table_prefix="weights_") as dyn:
        kjt, _ = next(batches(1))
        out = next(dyn.wrap([kjt]))
        t = dyn.tables.transformers["item"].local
        resident = set(t.slot_id[t.last_access != -1].tolist())
        for key in FEATURES[:2]:
            given, got = kjt[key], out[key]
            kept = [(i, w) for i, w in zip(given.values().tolist(), given.weights().tolist()) if i in resident]
            back = [(int(t.slot_id[s]), w) for s, w in zip(got.values().tolist(), got.weights().tolist())]
            assert back == kept, key
            assert len(kept) < len(given.values()), "the threshold was meant to leave IDs out"
