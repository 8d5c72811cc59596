"""A sequence model with dynamic tables: a user's recent items (unpooled, through an
EmbeddingCollection) score a candidate item from the same table.

Trains on synthetic sessions (a user's history comes mostly from one taste group; a candidate
of that group is clicked), in one process or under torchrun, with the embedded store (default)
or a PS, then prints the final loss and AUC. Item IDs are spread over 2^40.

    python examples/sequence.py                          # one process, embedded store
    torchrun --nproc_per_node 2 examples/sequence.py     # 2 ranks (gloo on CPU)
    python examples/sequence.py --store localhost:50051  # rows on a running PS
    torchrun --nproc_per_node 2 examples/sequence.py --store localhost:50051 --warm-start  # on from the rows left
    torchrun --nproc_per_node <GPUs> examples/sequence.py --device cuda    # one rank per GPU
    python examples/sequence.py --checkpoint-dir ckpt --steps 150    # then:
    python examples/sequence.py --checkpoint-dir ckpt --resume       # on from step 150
    python examples/sequence.py --export tables                      # table folders for serving

The lines that make the table dynamic are marked "# dynemb".
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dynemb import tables as dt
from dynemb.checkpoint import Checkpointer, CheckpointSettings, export_tables

DIM, GROUPS, ITEMS, HISTORY = 16, 8, 3_000, 8


class SequenceScorer(nn.Module):
    """Each history position's item embedding, weighted by recency and summed, against the
    candidate's embedding (the same table: one table, two features)."""

    def __init__(self, item_rows: int) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item", embedding_dim=DIM, num_embeddings=item_rows, feature_names=["history", "candidate"]
                )
            ],
            device=torch.device("meta"),
        )
        self.recency = nn.Parameter(torch.zeros(HISTORY))
        self.project = nn.Linear(DIM, DIM)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        seqs = self.ec(kjt)  # {feature: JaggedTensor of per-position embeddings}
        history, candidate = seqs["history"], seqs["candidate"]
        lengths = history.lengths().long()
        batch = len(lengths)
        device = history.values().device
        sample = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
        position = torch.arange(len(sample), device=device) - torch.repeat_interleave(
            history.offsets()[:-1].long(), lengths
        )
        weight = torch.softmax(self.recency, 0)[position.clamp(max=HISTORY - 1)].unsqueeze(1)
        user = torch.zeros(batch, DIM, device=device).index_add(0, sample, weight * history.values())
        return (self.project(user) * candidate.values()).sum(1)  # one candidate per sample


def batches(seed: int, batch_size: int, rank: int, world: int):
    """Endless (KJT of history and candidate, clicks)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank * 7 + world)
    item_ids = torch.randint(0, 1 << 40, (ITEMS,), generator=torch.Generator().manual_seed(54321))
    while True:
        group = torch.randint(0, GROUPS, (batch_size,), generator=gen)
        lengths = torch.randint(1, HISTORY + 1, (batch_size,), generator=gen)
        drawn = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * ITEMS).long()
        own = torch.rand(len(drawn), generator=gen) < 0.8  # 4 in 5 history items of the user's group
        drawn = torch.where(own, drawn - drawn % GROUPS + group.repeat_interleave(lengths), drawn)
        candidate = (torch.rand(batch_size, generator=gen) ** 2 * ITEMS).long()
        liked = torch.rand(batch_size, generator=gen) < 0.5
        candidate = torch.where(liked, candidate - candidate % GROUPS + group, candidate)
        clicks = (candidate % GROUPS == group).float()
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["history", "candidate"],
            values=torch.cat([item_ids[drawn], item_ids[candidate]]),
            lengths=torch.cat([lengths, torch.ones(batch_size, dtype=lengths.dtype)]).int(),
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
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--capacity", type=int, default=2048, help="item rows on the devices, all ranks together")
    p.add_argument("--store", default=None, help="PS addresses host:port[,host:port]; default: the embedded store")
    p.add_argument("--table-prefix", default="sequence_")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument(
        "--checkpoint-dir", default="", help="save a checkpoint here at the end (and every --checkpoint-every)"
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    rows_left = p.add_mutually_exclusive_group()  # what to do with the rows an earlier run left in the store
    rows_left.add_argument("--warm-start", action="store_true", help="train on from the rows an earlier run left")
    rows_left.add_argument("--fresh", action="store_true", help="drop the rows an earlier run left first")
    rows_left.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--export", default="", help="write the table's rows here as a table folder at the end")
    p.add_argument("--result-json", default="", help="write the losses, AUC and hit rate here (rank 0)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")

    device = dt.resolve_device(args.device)  # cuda: this rank's GPU (LOCAL_RANK)
    created = dt.init_distributed(device)  # dynemb: torchrun's group, or a group of one process
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SequenceScorer(-(-args.capacity // world) * world)  # an equal block of rows on each rank
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ec.parameters(), {"lr": 0.1})
    configs = [dt.TableConfig("item", policy="hybrid")]  # dynemb
    model = dt.shard_model(model, configs, device)  # dynemb: DMP, the table row-wise
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
            loss.backward()
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
