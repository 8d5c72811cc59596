"""A local PS (`dynemb ps serve`) in a child process on a free port, for benchmarks, demos
and tests; it stops when closed (or its `with` block ends). Redis: dynemb/testing/local_redis.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynemb.ps_server.parent_watch import PARENT_ENV
from dynemb.testing.process import TempDirProcess, end_process

REPO = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies, even by SIGKILL (Linux
    prctl PR_SET_PDEATHSIG), so a killed trainer or test leaves no process behind. For
    foreign binaries (preexec_fn); a dynemb PS does it itself (dynemb.ps_server.parent_watch)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LocalPS(TempDirProcess):
    """`dynemb ps serve` in a child process on a free port; `address` once started."""

    def __init__(self, *args: str, env: dict | None = None, log_path: str | None = None) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.dir = tempfile.mkdtemp(prefix="dynemb-ps-")
        self.log_path = log_path or os.path.join(self.dir, "ps.log")
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        """host:port of its gRPC service (set by start())."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> LocalPS:
        """Start the PS and wait until it has written its ports; returns self.

        Raises:
            RuntimeError: the PS exited or did not start within timeout seconds (its log in the message).
        """
        port_file = os.path.join(self.dir, "port")
        cmd = [
            sys.executable,
            *(
                "-m dynemb.cli ps serve --address 127.0.0.1:0 --metrics-port 0 --metrics-address 127.0.0.1 --port-file"
            ).split(),
            port_file,
            *self.args,
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env={**self.env, PARENT_ENV: str(os.getpid())}
        )
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PS did not start (exit {self.proc.poll()}):\n{self.log()}")
            time.sleep(0.05)
        grpc_port, metrics_port = open(port_file).read().split()
        self.port, self.metrics_port = int(grpc_port), int(metrics_port)
        return self

    def metrics_text(self) -> str:
        """What its /metrics endpoint says now (Prometheus text format)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def log(self) -> str:
        """Everything the PS has logged so far; empty if the log cannot be read."""
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the PS and wait up to timeout seconds (then kill it); its exit code, None if not running."""
        if self.proc is None:
            return None
        code = end_process(self.proc, sig, timeout)
        self.proc = None
        self._log.close()
        return code
