"""An own model's job, as a user writes it with dynemb.tables, against plain TorchRec full tables
on the same box: samples/s and the trainer's CPU time per sample, over the embedded store and
over a Redis PS (a `dynemb ps serve --backend redis://...` process and a redis-server of its
own; their CPU is printed apart, not in the trainer's).

    .venv/bin/python bench/own_model_bench.py             # one process, 4 tables of 20,000 IDs
    .venv/bin/python bench/own_model_bench.py --steps 400 --batch-size 512 --capacity-fraction 0.5

The model: 4 EmbeddingBag tables (dim 16, row-wise Adagrad fused), multi-hot features drawn
Zipf-like, a small MLP over them and 13 dense features. The full run holds every ID in its
tables, started by dt.start_full_tables as the store starts them, so all runs see the same
batches and their losses agree (printed). Timed after --warmup steps; the trainer's CPU is its
process's (every thread), from time.process_time.

The trainer's OpenMP threads (torch's intra-op ones, printed) spin after each parallel region
by default (libgomp: for ~300,000 pauses, milliseconds) before they sleep: while the trainer
waits on a PS and a redis-server that share its cores, the spinning takes the cores they need,
and on 2 cores that was most of the Redis run's trainer CPU (bench/RESULTS.md). Set
OMP_WAIT_POLICY=passive (before Python starts) to measure without it:

    OMP_WAIT_POLICY=passive .venv/bin/python bench/own_model_bench.py --steps 1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

TABLES, DIM, DENSE = ["user", "item", "shop", "query"], 16, 13


def make_model(rows: int, universe: int):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"{t}_id"])
                    for t in TABLES
                ],
                device=torch.device("meta"),
            )
            self.mlp = nn.Sequential(nn.Linear(DENSE + DIM * len(TABLES), 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.mlp(torch.cat([dense, self.ebc(kjt).values()], 1)).squeeze(1)

    return Own()


def batches(steps: int, batch_size: int, universe: int):
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(7)
    keys = [f"{t}_id" for t in TABLES]
    for _ in range(steps):
        lengths = torch.randint(1, 4, (len(TABLES) * batch_size,), generator=gen)
        values = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * universe).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        yield torch.randn(batch_size, DENSE, generator=gen), kjt, (torch.rand(batch_size, generator=gen) < 0.3).float()


def run(kind: str, args, store: str | None) -> dict:
    """One job: "full" (plain TorchRec tables) or dynamic tables over `store`."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from dynemb import tables as dt

    configs = [dt.TableConfig(t, policy="lru") for t in TABLES]
    rows = args.universe if kind == "full" else int(args.universe * args.capacity_fraction)
    torch.manual_seed(0)
    model = make_model(rows, args.universe)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.05})
    model = dt.shard_model(model, configs)
    dense = torch.optim.SGD(dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    data = batches(args.warmup + args.steps, args.batch_size, args.universe)
    losses: list[float] = []
    timed: dict[str, float] = {}

    def train(loop) -> None:
        for k, (x, kjt, y) in enumerate(loop):
            if k == args.warmup:
                timed.update(wall=time.perf_counter(), cpu=time.process_time())
            loss = loss_fn(model(x, kjt), y)
            dense.zero_grad()
            loss.backward()
            dense.step()
            losses.append(loss.item())

    hit = 1.0
    if kind == "full":
        dt.start_full_tables(model, configs)
        train(data)
    else:
        with dt.DynamicEmbeddings(model, configs, store=store, start="fresh", table_prefix=f"bench_{kind}_") as dyn:
            train(dyn.wrap(data))
            hit = dyn.hit_rate()[0]
    wall, cpu = time.perf_counter() - timed["wall"], time.process_time() - timed["cpu"]
    samples = args.steps * args.batch_size
    return {"samples_per_s": samples / wall, "cpu_us_per_sample": 1e6 * cpu / samples, "losses": losses, "hit": hit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="timed steps [default %(default)s]")
    p.add_argument("--warmup", type=int, default=20, help="steps before timing [default %(default)s]")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--universe", type=int, default=20_000, help="IDs a table [default %(default)s]")
    p.add_argument("--capacity-fraction", type=float, default=0.25, help="dynamic rows a table, of its IDs")
    p.add_argument("--no-redis", action="store_true", help="leave out the run over a Redis PS")
    args = p.parse_args(argv)

    from dynemb import tables as dt
    from dynemb.testing.local_ps import LocalPS
    from dynemb.testing.local_redis import RedisProcess

    created = dt.init_distributed("cpu")
    print(
        f"own_model_bench: 1 process, {len(TABLES)} tables of {args.universe:,} IDs (dim {DIM}), batches of "
        f"{args.batch_size}, {args.steps} timed steps, dynamic capacity {args.capacity_fraction:.0%}; "
        f"{torch.get_num_threads()} intra-op threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    results = {"full": run("full", args, None), "embedded": run("embedded", args, None)}
    ps_cpu = None
    if not args.no_redis:
        with RedisProcess() as redis, LocalPS("--backend", redis.url, "--log-level", "WARNING") as ps:
            results["redis PS"] = run("redis", args, ps.address)
            assert ps.proc is not None and redis.proc is not None
            ps_cpu = (_cpu_seconds(ps.proc.pid), _cpu_seconds(redis.proc.pid))
    base = results["full"]
    for name, r in results.items():
        gap = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        speed, cpu = r["samples_per_s"], r["cpu_us_per_sample"]
        print(
            f"  {name:<9} {speed:>9,.0f} samples/s ({speed / base['samples_per_s']:.2f}x)  "
            f"trainer CPU {cpu:7.1f} us/sample ({cpu / base['cpu_us_per_sample']:.2f}x)"
            f"  hit rate {r['hit']:.3f}  losses within {gap:.1e} of full"
        )
    if ps_cpu is not None:
        samples = args.steps * args.batch_size
        print(
            f"  beside the redis PS run: the PS process {ps_cpu[0]:.1f} s CPU, redis-server {ps_cpu[1]:.1f} s "
            f"(whole run, start-up included; {1e6 * sum(ps_cpu) / samples:.1f} us/sample of the timed steps' count)"
        )
    if created:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
