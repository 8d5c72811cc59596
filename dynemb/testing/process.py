"""What the local PS, Redis and other test processes share: stopping a child, a temp folder."""

from __future__ import annotations

import shutil
import signal
import subprocess


def end_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
    """Signals a child (if still running), waits up to `timeout` s, then kills it.

    Returns:
        Its exit code (negative: the signal that ended it).
    """
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class TempDirProcess:
    """A child process with a temp folder of its own: `close()` (or the `with` block's end)
    stops it and removes the folder. Subclasses set `dir` and define start() and stop()."""

    dir: str

    def start(self, *args, **kwargs):
        """Start the process; returns self (what `with` binds)."""
        raise NotImplementedError

    def stop(self, *args, **kwargs):
        """Stop the process; the folder stays."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the process and remove its folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
