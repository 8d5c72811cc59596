"""`dynemb train` and `python -m dynemb.trainer` (what torchrun runs): the DLRM training job."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys

from dynemb.common.cli_args import Parser

DESCRIPTION = """Train a DLRM (13 dense, 26 sparse features) with dynamic embedding tables: each
table keeps --capacity-fraction of its IDs on the device and every row in the parameter
server. One process:   dynemb train --steps 300
Several ranks:          torchrun --nproc_per_node 2 -m dynemb.trainer --steps 300
Data: synthetic Criteo-like batches (default) or --source FILE.tsv in Criteo format.
Prints the loss as it goes and the held-out AUC and log-loss at the end."""


def add_parser(sub) -> argparse.ArgumentParser:
    """Add `dynemb train` to the CLI's subcommands `sub`; returns its parser."""
    p = sub.add_parser(
        "train",
        help="train a DLRM with dynamic embedding tables",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    """Give parser `p` the training settings' flags (config.py), --result-json, and run()."""
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
    """Train with the parsed flags; exit status (0, 1 for a user's error said in one line, 2 for bad settings)."""
    from dynemb.trainer.config import from_args

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_library_warnings()
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = from_args(args)
    except (ValueError, OSError) as e:
        if rank == 0:  # every rank reads the same flags and files: one says it
            print(f"dynemb train: error: {e}", file=sys.stderr)
        return 2
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
    import torch.distributed as dist

    from dynemb.tables import TORCHREC_ERROR, DeviceUnavailable, init_distributed, resolve_device

    if cfg.model == "dlrm" and TORCHREC_ERROR:  # fbgemm-gpu (and with it TorchRec) does not load here
        if rank == 0:
            print(
                f"dynemb: note: TorchRec did not load ({TORCHREC_ERROR}); training the plain model "
                f"(torch EmbeddingBags, one process: --model plain) instead",
                file=sys.stderr,
                flush=True,
            )
        cfg = dataclasses.replace(cfg, model="plain")
    if cfg.model == "plain":
        from dynemb.trainer.plain import train_plain as train
    else:
        from dynemb.trainer.train import train

    try:
        device = resolve_device(cfg.device)
    except DeviceUnavailable as e:  # every rank of the machine alike, before any group: one says it
        if rank == 0 or int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"dynemb: error: {e}", file=sys.stderr, flush=True)
        return 1
    # the job's process group is made here rather than in train(), so that it outlives a
    # failure: the ranks agree on which one reports it (_report)
    created = init_distributed(device)
    try:
        try:
            result = train(cfg)
        except Exception as exc:
            if _peer_gone(exc):
                if _reported_elsewhere():
                    return 1  # another rank stopped the job, and said why
                # it died unheard (killed, its node gone): under torchrun --max-restarts an
                # elastic agent restarts the job, which goes on with --resume auto
                print(
                    f"dynemb: error: rank {rank}: another rank of the job is gone without a word "
                    f"(killed, or its node went away): {str(exc).splitlines()[0]}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            failure = _failure(exc)
            if failure is None:  # not a user's error: a bug, with its traceback
                raise
            return _report(*failure)
        return _finish(args, cfg, rank, result)
    finally:
        if created:
            dist.destroy_process_group()


# how long the ranks of a failed job wait for the one that reports it (_report)
AGREE_SECONDS = 30.0
LOWEST_SHOWN = 3  # tables named in the summary's lowest hit rates
# what a refused batch (too many distinct IDs for a table, no room) says a user can do
_FIT_ADVICE = (
    "raise --capacity or --capacity-fraction, or lower --batch-size or --prefetch "
    "(each batch transformed ahead holds its rows too)"
)


def _failure(exc: Exception) -> tuple[str, int | None] | None:
    """A user's error as one line, and the rank that reports it: 0 for an error every rank
    raises alike (a checkpoint or PS check, a setting), the first refusing rank for a refused
    batch (it alone knows why), None where this rank alone has it (its data). None: a bug."""
    import torch.distributed as dist

    from dynemb.common.errors import UserError
    from dynemb.idtransformer.sharded import BatchRefused
    from dynemb.idtransformer.transformer import NoRoom, TooManyIDs
    from dynemb.ps_server.errors import PSError, TableExists
    from dynemb.trainer.config import table_name
    from dynemb.trainer.data import BadLine
    from dynemb.trainer.full_tables import IDOutOfRange

    if isinstance(exc, BadLine):
        return f"malformed training data: {exc} (--skip-bad-lines skips such lines)", None
    if isinstance(exc, IDOutOfRange):  # this rank's data
        return str(exc), None
    if isinstance(exc, BatchRefused):  # on every rank; a refusing one's errors say why
        refusing = sorted({r for ranks in exc.refused_by for r in ranks})
        own = [(t, e) for t, e in enumerate(exc.errors) if e is not None]
        if not refusing or not own:  # not the reporter (or nothing to name): what every rank knows
            return f"{exc}; {_FIT_ADVICE}", refusing[0] if refusing else 0
        t, first = own[0]
        fits = "a batch does not fit its table" if isinstance(first, (TooManyIDs, NoRoom)) else "a batch was refused"
        rank, world = dist.get_rank(), dist.get_world_size()
        more = sum(map(len, exc.refused_by)) - 1  # shares refused: (table, rank) pairs
        by = f" (ranks {', '.join(map(str, refusing))})" if world > 1 else ""
        others = f"; {more} more of its tables' shares were refused{by}" if more else ""
        where = f"table {table_name(t)}" + (f" on rank {rank}" if world > 1 else "")
        return f"{fits}: {where}: {first}{others}; {_FIT_ADVICE}", refusing[0]
    if isinstance(exc, (TooManyIDs, NoRoom)):
        return f"a batch does not fit its table: {exc}; {_FIT_ADVICE}", 0
    if isinstance(exc, TableExists):  # another job's table, or this job's from a run with other settings
        return (
            f"{exc} (give this job tables of its own with --ps-table-prefix, run with the settings of the "
            f"job that made them, or drop them with --fresh)",
            0,
        )
    if isinstance(exc, PSError):
        if exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED") or "not ready" in str(exc):
            return f"{exc} (is the PS at --ps running, and reachable from here?)", 0
        return str(exc), 0
    if isinstance(exc, UserError):
        return str(exc), 0
    if isinstance(exc, OSError) and exc.filename:  # a file of the job's (--source, a checkpoint's)
        return f"{exc.filename}: {exc.strerror or exc}", 0
    return None


def _report(message: str, reporter: int | None) -> int:
    """Print a failure once for the job: by `reporter` (None: by this rank, naming it), while
    the other ranks wait until it has and then leave quietly. A rank that the reporter does
    not join within AGREE_SECONDS (it failed otherwise, or is gone) says it itself."""
    from datetime import timedelta

    import torch.distributed as dist

    from dynemb.tables import control_group

    rank, world = dist.get_rank(), dist.get_world_size()

    def say(text: str) -> None:
        print(f"dynemb: error: {text}", file=sys.stderr, flush=True)

    if world == 1 or reporter is None:
        say(message if world == 1 else f"rank {rank}: {message}")
        _mark_reported()
        return 1
    if rank == reporter:
        say(message)
        _mark_reported()
    try:  # torchrun stops every rank once one has exited: none leaves before the reporter spoke
        # on gloo: NCCL has no monitored_barrier, so a job on GPUs waits in its gloo control group
        dist.monitored_barrier(group=control_group(), timeout=timedelta(seconds=AGREE_SECONDS), wait_all_ranks=True)
    except Exception:  # noqa: BLE001 - whatever kept the ranks apart, this rank's error is said
        if rank != reporter:
            say(f"rank {rank}: {message}")
    return 1


# in the job's store (torchrun's rendezvous): a rank has said why the job stops
_REPORTED = "dynemb/failure-reported"


def _mark_reported() -> None:
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        _get_default_store().set(_REPORTED, "1")
    except Exception:  # noqa: BLE001 - the others then say their own error: more lines, nothing lost
        pass


def _reported_elsewhere() -> bool:
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store().check([_REPORTED])
    except Exception:  # noqa: BLE001 - unknown: this rank's error is shown
        return False


def _peer_gone(exc: BaseException | None) -> bool:
    """Whether exc is gloo's (or NCCL's) on a rank whose peer left: it failed (a malformed line
    of its data, say) and exited, or was killed. The rank that failed says why, not this one."""
    while exc is not None:
        if isinstance(exc, RuntimeError) and any(
            s in str(exc) for s in ("Connection closed by peer", "Connection reset by peer", "remote process exited")
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _finish(args: argparse.Namespace, cfg, rank: int, result) -> int:
    """The end of a job that trained: its figures on rank 0 (and --result-json)."""
    if rank == 0:
        tail = result.losses[-cfg.log_every :] or [float("nan")]
        resumed = f" (resumed at step {result.first_step})" if result.first_step else ""
        print(
            f"steps {len(result.losses)}{resumed}  final loss {sum(tail) / len(tail):.4f}  "
            f"eval AUC {result.auc:.4f}  eval log-loss {result.logloss:.4f}  "
            f"{result.samples_per_second:,.0f} samples/s"
            + (f"  hit rate {result.hit_rate:.3f}" if cfg.table.dynamic else "")
        )
        if result.table_hit_rates:  # a thrashing table is named, not averaged away among the others
            lowest = sorted(result.table_hit_rates.items(), key=lambda kv: kv[1])[:LOWEST_SHOWN]
            print("lowest hit rates: " + "  ".join(f"{name} {rate:.3f}" for name, rate in lowest))
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
                    "table_hit_rates": result.table_hit_rates,
                    "evals": [{"step": k, "auc": auc, "logloss": loss} for k, auc, loss in result.evals],
                    "data_ran_out": result.data_ran_out,
                },
                f,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dynemb.trainer` (what torchrun runs): parse argv, train; exit status."""
    p = Parser(
        prog="python -m dynemb.trainer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)
