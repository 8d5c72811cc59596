"""A PS started by another process (a test, a benchmark, a trainer's helper) ends with it.

The parent sets PARENT_ENV to its pid; `dynemb ps serve` calls die_with_parent() first thing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

#: set by a parent that wants its dynemb child gone with it (to its own pid)
PARENT_ENV = "DYNEMB_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """Called early by `dynemb ps serve`: if started by LocalPS, end (SIGTERM, a graceful
    drain) once that parent process is gone, even killed by SIGKILL.

    A watcher thread sees the parent go: the process is then re-parented. Two other ways
    fail. PR_SET_PDEATHSIG signals when the *thread* that started the child ends, so a PS
    started from a short-lived thread died at once. A preexec_fn runs between fork and exec,
    which Python documents as unsafe in a process with threads (the parent has gRPC's); a PS
    now and then aborted at start with gRPC's epoll poller finding a bad file descriptor."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent:
        return
    parent_pid = int(parent)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dynemb-parent-watch", daemon=True).start()
