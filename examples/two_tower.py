"""A two-tower retrieval model with dynamic tables: users and items hashed over 2^40.

Trains on synthetic clicks (a user clicks items of its own taste group), in one process or under
torchrun, with the embedded store (default) or a PS, then prints the final loss and AUC.

    python examples/two_tower.py                         # one process, embedded store
    torchrun --nproc_per_node 2 examples/two_tower.py    # 2 ranks (gloo on CPU)
    python examples/two_tower.py --store localhost:50051 # rows on a running PS (dynemb ps serve)
    torchrun --nproc_per_node 2 examples/two_tower.py --store localhost:50051 --warm-start  # on from the rows left
    torchrun --nproc_per_node <GPUs> examples/two_tower.py --device cuda   # one rank per GPU
    python examples/two_tower.py --checkpoint-dir ckpt --steps 150       # then:
    python examples/two_tower.py --checkpoint-dir ckpt --resume          # on from step 150
    python examples/two_tower.py --export tables                         # table folders for serving

The lines that make the tables dynamic are marked "# dynemb".
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from dynemb import tables as dt
from dynemb.checkpoint import Checkpointer, CheckpointSettings, export_tables

DIM, GROUPS = 16, 8
USERS, ITEMS = 4_000, 1_000  # distinct IDs seen; their values spread over 2^40


class TwoTower(nn.Module):
    """user_id -> user tower, item_id -> item tower; the logit is their dot product."""

    def __init__(self, user_rows: int, item_rows: int) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=user_rows, feature_names=["user_id"]),
                EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=item_rows, feature_names=["item_id"]),
            ],
            device=torch.device("meta"),
        )
        self.user_tower = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, DIM))
        self.item_tower = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, DIM))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        user, item = self.user_tower(pooled["user_id"]), self.item_tower(pooled["item_id"])
        return (user * item).sum(1)


def batches(seed: int, batch_size: int, rank: int, world: int):
    """Endless (KJT of user_id and item_id, clicks): IDs drawn with a skew, spread over 2^40; half
    the items shown are of the user's taste group, and a click is such an item (1 in 10 flipped)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank * 7 + world)
    spread = torch.Generator().manual_seed(12345)  # the same ID values on every rank and run
    user_ids = torch.randint(0, 1 << 40, (USERS,), generator=spread)
    item_ids = torch.randint(0, 1 << 40, (ITEMS,), generator=spread)
    while True:
        users = (torch.rand(batch_size, generator=gen) ** 2 * USERS).long()
        items = (torch.rand(batch_size, generator=gen) ** 2 * ITEMS).long()
        liked = torch.rand(batch_size, generator=gen) < 0.5
        items = torch.where(liked, items - items % GROUPS + users % GROUPS, items)
        clicks = (users % GROUPS == items % GROUPS).float()
        flip = torch.rand(batch_size, generator=gen) < 0.1
        clicks = torch.where(flip, 1 - clicks, clicks)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["user_id", "item_id"],
            values=torch.cat([user_ids[users], item_ids[items]]),
            lengths=torch.ones(2 * batch_size, dtype=torch.int32),
        )
        yield kjt, clicks


def main(argv: list[str] | None = None) -> dict:
    # Whole flags only (allow_abbrev=False): under torchrun, its parser reads them too and refuses one that could
    # abbreviate its own (--start for --start-method); none here can (tests/test_examples.py checks).
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="cuda: one rank per GPU (NCCL)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--capacity", type=int, default=1024, help="rows per table on the devices, all ranks together")
    p.add_argument("--store", default=None, help="PS addresses host:port[,host:port]; default: the embedded store")
    p.add_argument("--table-prefix", default="two_tower_")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument(
        "--checkpoint-dir", default="", help="save a checkpoint here at the end (and every --checkpoint-every)"
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    rows_left = p.add_mutually_exclusive_group()  # what to do with the rows an earlier run left in the store
    rows_left.add_argument("--warm-start", action="store_true", help="train on from the rows an earlier run left")
    rows_left.add_argument("--fresh", action="store_true", help="drop the rows an earlier run left first")
    rows_left.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--export", default="", help="write every table's rows here as table folders at the end")
    p.add_argument("--result-json", default="", help="write the losses, AUC and hit rate here (rank 0)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")

    device = dt.resolve_device(args.device)  # cuda: this rank's GPU (LOCAL_RANK)
    created = dt.init_distributed(device)  # dynemb: torchrun's group, or a group of one process
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    capacity = -(-args.capacity // world) * world  # an equal block of rows on each rank
    model = TwoTower(capacity, capacity)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})
    configs = [dt.TableConfig("user", policy="lru"), dt.TableConfig("item", policy="hybrid")]  # dynemb
    model = dt.shard_model(model, configs, device)  # dynemb: DMP, the tables row-wise
    dense = torch.optim.Adam(dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    losses = []
    # rows an earlier run left: refused ("new") unless told; a checkpoint's restore replaces them ("resume")
    start = "resume" if args.resume else "warm" if args.warm_start else "fresh" if args.fresh else "new"
    with dt.DynamicEmbeddings(  # dynemb
        model, configs, store=args.store, start=start, table_prefix=args.table_prefix
    ) as dyn:
        ckpt = None
        if args.checkpoint_dir:  # dynemb: the model, its dense optimizer, every row and ID transformer
            settings = CheckpointSettings(batch_size=args.batch_size, directory=args.checkpoint_dir)
            ckpt = Checkpointer.of(dyn, dense, settings)
        first = ckpt.restore("latest") if ckpt is not None and args.resume else 0  # dynemb
        train = itertools.islice(batches(1, args.batch_size, rank, world), first, args.steps)
        for step, (kjt, clicks) in enumerate(dyn.wrap(train), start=first + 1):  # dynemb: IDs in, slots out
            loss = loss_fn(model(kjt.to(device)), clicks.to(device))
            dense.zero_grad()
            loss.backward()  # the tables' optimizer runs inside the backward
            dense.step()
            losses.append(loss.item())
            if ckpt is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
                ckpt.save(step)  # dynemb: collective, at a step boundary
        if (
            ckpt is not None
            and args.steps > first
            and (not args.checkpoint_every or args.steps % args.checkpoint_every)
        ):
            ckpt.save(args.steps)
        logits, labels = [], []
        held_out = (b for _, b in zip(range(args.eval_batches), batches(2, args.batch_size, rank, world)))
        with torch.no_grad():
            for kjt, clicks in dyn.wrap(held_out, train=False):  # dynemb: nothing admitted or pushed
                logits.append(model(kjt.to(device)))
                labels.append(clicks.to(device))
        hit_rate, _ = dyn.hit_rate()
        if args.export:  # dynemb: every row, from the PS or every rank's embedded store
            exported = export_tables(dyn, args.export, overwrite=True, progress=False)
            if rank == 0:
                print(f"exported {', '.join(f'{n} {m.num_rows:,} rows' for n, m in exported.items())} to {args.export}")
    local = torch.stack([torch.cat(logits), torch.cat(labels)])
    every = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(every, local)
    logit, label = torch.cat(every, 1)
    auc = float(binary_auroc(torch.sigmoid(logit), label.long()))
    final = sum(losses[-20:]) / max(len(losses[-20:]), 1)
    if rank == 0:
        print(f"steps {first + len(losses)}  final loss {final:.4f}  eval AUC {auc:.4f}  hit rate {hit_rate:.3f}")
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump({"first": first, "losses": losses, "auc": auc, "hit_rate": hit_rate}, f)
    if created:
        dist.destroy_process_group()
    return {"losses": losses, "auc": auc, "hit_rate": hit_rate}


if __name__ == "__main__":
    main()
