"""`dynemb train` and `python -m dynemb.trainer` (what torchrun runs): the DLRM training job."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys

DESCRIPTION = """Train a DLRM (13 dense, 26 sparse features) with dynamic embedding tables: each
table keeps --capacity-fraction of its IDs on the device and every row in the parameter
server. One process:   dynemb train --steps 300
Several ranks:          torchrun --nproc_per_node 2 -m dynemb.trainer --steps 300
Data: synthetic Criteo-like batches (default) or --source FILE.tsv in Criteo format.
Prints the loss as it goes and the held-out AUC and log-loss at the end."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a DLRM with dynamic embedding tables",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    from dynemb.trainer.config import add_arguments

    add_arguments(p)
    p.add_argument(
        "--result-json",
        help="also write the final figures (and every step's loss) to this file; "
        "rank 0's, or each rank's where the name has {rank} in it",
    )
    p.set_defaults(func=run)


def quiet_library_warnings() -> None:
    """TorchRec, torchmetrics and torch.fx warn about their own deprecations on every run;
    they say nothing a user of this job can act on, and they bury the progress bar."""
    import warnings

    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("torchrec", "torch.fx", "torch.distributed", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run(args: argparse.Namespace) -> int:
    from dynemb.trainer.config import from_args

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_library_warnings()
    try:
        cfg = from_args(args)
    except (ValueError, OSError) as e:
        print(f"dynemb train: error: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _train(args, cfg, rank)
    finally:
        # The job's process groups live on in its cyclic garbage (the model, a failed step's
        # frames) until a collection: made now, their gloo threads are joined while the
        # interpreter is whole. Left to interpreter shutdown, a thread that finishes a
        # collective's work there takes the GIL and aborts the process ("terminate called
        # without an active exception"), the job's exit status lost.
        gc.collect()


def _train(args: argparse.Namespace, cfg, rank: int) -> int:
    from dynemb.idtransformer.sharded import BatchRefused
    from dynemb.idtransformer.transformer import NoRoom, TooManyIDs
    from dynemb.trainer.data import BadLine
    from dynemb.trainer.train import train

    try:
        result = train(cfg)
    except BadLine as e:
        print(
            f"dynemb train: error: rank {rank}: malformed training data: {e} (--skip-bad-lines skips such lines)",
            file=sys.stderr,
        )
        return 1
    except (BatchRefused, TooManyIDs, NoRoom) as e:  # BatchRefused: on every rank, the refusing one's cause says why
        if isinstance(e.__cause__ if isinstance(e, BatchRefused) else e, (TooManyIDs, NoRoom)):
            print(
                f"dynemb train: error: rank {rank}: a batch does not fit its table: {e} "
                f"(raise --capacity / --capacity-fraction, or lower --batch-size or --prefetch: "
                f"each batch transformed ahead holds its rows too)",
                file=sys.stderr,
            )
        else:
            print(f"dynemb train: error: rank {rank}: {e}", file=sys.stderr)
        return 1
    if rank == 0:
        tail = result.losses[-cfg.log_every :] or [float("nan")]
        resumed = f" (resumed at step {result.first_step})" if result.first_step else ""
        print(
            f"steps {len(result.losses)}{resumed}  final loss {sum(tail) / len(tail):.4f}  "
            f"eval AUC {result.auc:.4f}  eval log-loss {result.logloss:.4f}  "
            f"{result.samples_per_second:,.0f} samples/s"
            + (f"  hit rate {result.hit_rate:.3f}" if cfg.table.dynamic else "")
        )
    if args.result_json and (rank == 0 or "{rank}" in args.result_json):  # never two ranks on one file
        path = args.result_json.replace("{rank}", str(rank))
        with open(path, "w") as f:
            json.dump(
                {
                    "losses": result.losses,
                    "auc": result.auc,
                    "logloss": result.logloss,
                    "samples_per_second": result.samples_per_second,
                    "hit_rate": result.hit_rate,
                },
                f,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dynemb.trainer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)
