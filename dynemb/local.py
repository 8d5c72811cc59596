"""Local processes for benchmarks, demos and tests: a redis-server and a PS (`dynemb ps serve`).

Both run as real child processes on free loopback ports and stop when the object is
closed (or its `with` block ends).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """DYNEMB_REDIS_SERVER, else the repo's .bin/redis-server (scripts/setup_env.sh), else PATH."""
    for candidate in (os.environ.get("DYNEMB_REDIS_SERVER"), str(REPO / ".bin" / "redis-server"), shutil.which("redis-server")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("no redis-server found: run scripts/setup_env.sh, or set DYNEMB_REDIS_SERVER")


class LocalRedis:
    """A throwaway redis-server: no persistence, its own temp dir."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="dynemb-redis-")
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        import redis

        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class LocalPS:
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
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "LocalPS":
        port_file = os.path.join(self.dir, "port")
        cmd = [sys.executable, "-m", "dynemb.cli", "ps", "serve", "--address", "127.0.0.1:0",
               "--metrics-port", "0", "--metrics-address", "127.0.0.1", "--port-file", port_file, *self.args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PS did not start (exit {self.proc.poll()}):\n{self.log()}")
            time.sleep(0.05)
        grpc_port, metrics_port = open(port_file).read().split()
        self.port, self.metrics_port = int(grpc_port), int(metrics_port)
        return self

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        self._log.close()
        return code

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalPS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
