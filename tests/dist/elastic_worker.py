"""Run by two torchrun agents from tests/test_elastic.py: `python -m dynemb.trainer` with the
given flags. The agent whose environment has DYNEMB_TEST_NODE_DIES_AFTER=k stands for a node
that goes away: on its first attempt its rank, once the step-k checkpoint is complete, kills
its agent (SIGKILL: no goodbye to the rendezvous) and itself."""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from dynemb.trainer.checkpoint import Checkpointer  # noqa: E402
from dynemb.trainer.cli import main  # noqa: E402

DIES_AFTER = int(os.environ.get("DYNEMB_TEST_NODE_DIES_AFTER", "0"))

if DIES_AFTER and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    save = Checkpointer.save

    def save_then_die(self, step: int):
        folder = save(self, step)  # every rank is past the save: the checkpoint is complete
        if step == DIES_AFTER:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: its node is gone
            os._exit(1)
        return folder

    Checkpointer.save = save_then_die  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
