"""Run by torchrun agents from tests/checkpoint/test_elastic.py: `python -m dynemb.trainer` with the given
flags, and what the environment asks of a test node:

DYNEMB_TEST_NODE_DIES_AFTER=k: the node goes away. On its first attempt its rank, once the
step-k checkpoint is complete, kills its agent (SIGKILL: no goodbye to the rendezvous) and
itself.

DYNEMB_TEST_ALONE_CUT_AT=k: while the job has one rank, its step-k checkpoint is cut off at
the last moment: every file and the manifest written in the .partial folder, then the rank
waits there (a slow shared filesystem, say) until its agent stops it, as it does when a node
joins. Not complete: a resumed job must not take it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import dynemb.checkpoint.checkpoint as checkpoint  # noqa: E402
from dynemb.checkpoint.checkpoint import Checkpointer  # noqa: E402
from dynemb.checkpoint.format import MANIFEST  # noqa: E402
from dynemb.trainer.cli import main  # noqa: E402

DIES_AFTER = int(os.environ.get("DYNEMB_TEST_NODE_DIES_AFTER", "0"))
CUT_AT = int(os.environ.get("DYNEMB_TEST_ALONE_CUT_AT", "0"))

if DIES_AFTER and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    save = Checkpointer.save

    def save_then_die(self, step: int):
        folder = save(self, step)  # every rank is past the save: the checkpoint is complete
        if step == DIES_AFTER:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: its node is gone
            os._exit(1)
        return folder

    Checkpointer.save = save_then_die  # type: ignore[method-assign]

if CUT_AT and os.environ.get("WORLD_SIZE") == "1":
    write_manifest = checkpoint.write_manifest

    def write_then_wait(work, manifest, final):
        if manifest["step"] != CUT_AT:
            return write_manifest(work, manifest, final)
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        print(f"test: step-{CUT_AT} checkpoint cut off before its rename", file=sys.stderr, flush=True)
        while True:  # until the agent's SIGTERM
            time.sleep(1)

    checkpoint.write_manifest = write_then_wait  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
