"""Which device a rank trains on, and the process groups that go with it.

--device cpu: every rank on the CPU, gloo. --device cuda: one rank per GPU, rank with
LOCAL_RANK l on cuda:l, NCCL; a gloo group of the same ranks beside it (control_group) for
the training thread's control collectives: what NCCL lacks (monitored_barrier, used to agree
on who reports a failure), checkpoints, restores and table exports (Python objects and CPU
tensors, no GPU memory or NCCL stream involved). --device auto: cuda when torch sees a GPU,
else cpu. Which thread drives which group: docs/design.md, "Communicators and threads".

    device = resolve_device("auto")
    init_distributed(device)               # nccl on cuda, gloo on cpu
    t = torch.zeros(1, device=collective_device())   # what the default group's collectives take
"""

from __future__ import annotations

import atexit
import gc
import os

import torch
import torch.distributed as dist

from dynemb.common.errors import UserError

# (the default group, the gloo group made beside it): control_group()'s while that default
# group is the current one
_control: tuple[dist.ProcessGroup | None, dist.ProcessGroup] | None = None
_made_default = False  # whether init_distributed made a default group (held by no reference here: see below)


class DeviceUnavailable(UserError):
    """--device cuda where this rank has no GPU of its own."""


def resolve_device(name: str) -> torch.device:
    """The device of this rank for --device `name` (auto, cpu, cuda); on cuda also made the
    current device of the calling thread.

    Raises:
        DeviceUnavailable: cuda without a visible GPU, or with more local ranks
            (LOCAL_WORLD_SIZE, LOCAL_RANK) than GPUs.
        ValueError: an unknown name.
    """
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"--device cuda: no CUDA GPU is visible (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'none: a CPU-only build'}); use --device cpu or auto"
        )
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if max(local_world, local_rank + 1) > gpus:
        raise DeviceUnavailable(
            f"--device cuda: {max(local_world, local_rank + 1)} ranks on this machine but {gpus} GPU"
            f"{'s' if gpus != 1 else ''}: one rank per GPU (torchrun --nproc_per_node {gpus})"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend of a job on `device`: nccl on cuda, gloo on cpu."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device | None = None) -> bool:
    """Join torchrun's group (RANK, WORLD_SIZE in the environment), or make a one-process one,
    with the device's backend; on NCCL also the gloo control group. True if this call
    created the group."""
    if dist.is_initialized():
        return False
    backend = backend_for(device or torch.device("cpu"))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        # an in-process store: a group of one needs no rendezvous (and no port)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    global _made_default
    _made_default = True
    if backend == "nccl":
        add_control_group()
    return True


@atexit.register
def _end_groups_at_exit() -> None:
    """End the process groups' threads while the interpreter is whole.

    A gloo group's worker threads live as long as the group object, and a destroyed group
    often still is alive at exit, held by a sharded model's reference cycles. A worker that
    releases its last collective's tensors once the interpreter is finalizing takes the GIL,
    which Python answers with pthread_exit inside C++ that cannot be unwound: the process
    aborts ("terminate called without an active exception") after the job has done its work.
    So: destroy the default group if init_distributed made it and the job left it, then collect
    the garbage that holds destroyed groups (their destructors join the threads, GIL released).
    Registered at import, so that it runs after the handlers of the job's own (last in, first out)."""
    if _made_default and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def add_control_group() -> dist.ProcessGroup:
    """Collective (every rank, in the same order as its other new groups): a gloo group of
    every rank beside the default group, control_group()'s from now on, as long as that
    default group is the current one. init_distributed makes it on NCCL; on gloo, a job (or a
    test) may make one to run its control collectives as a NCCL job does, on a group of
    their own."""
    global _control
    group = dist.new_group(backend="gloo")
    _control = (dist.group.WORLD, group)
    return group


def ensure_control_group() -> dist.ProcessGroup | None:
    """control_group(), made first beside a NCCL default group that has none (a job that made
    its NCCL group itself, not through init_distributed). Collective where it makes one: every
    rank calls it at the same point (the constructors and collectives that call it are)."""
    if dist.get_backend() == "nccl" and control_group() is None:
        add_control_group()
    return control_group()


def control_group() -> dist.ProcessGroup | None:
    """The gloo group of every rank for the training thread's control collectives
    (monitored_barrier, checkpoints, restores, table exports): the one made beside the default
    group (on NCCL: by init_distributed), else the default group itself (None), a gloo one."""
    if _control is not None and dist.is_initialized() and _control[0] is dist.group.WORLD:
        return _control[1]
    return None


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of `group`'s collectives live: the current GPU on NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
