"""A baseline for bench/ps_bench.py: raw gRPC moving a pull's and a push's bytes, no PS code.

    python bench/raw_grpc.py --row-bytes N --port-file F    # the server (ps_bench starts it)

The server is its own process, as the PS is: it answers a Pull of n ids (8 bytes each)
with a ready-made payload of n rows and takes Push requests without reading them. What is left is
the cost of gRPC's Python stack on both sides (the copies into and out of its buffers,
HTTP/2, loopback TCP): the floor under what any Python gRPC PS can do here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def serve(row_bytes: int, port_file: str) -> None:
    replies: dict[int, bytes] = {}  # by request size: made once, then sent as they are

    def pull(request: bytes, context) -> bytes:
        if len(request) not in replies:
            replies[len(request)] = b"\0" * (len(request) // 8 * row_bytes)
        return replies[len(request)]

    server = grpc.server(futures.ThreadPoolExecutor(16), options=OPTIONS)
    handlers = {
        "Pull": grpc.unary_unary_rpc_method_handler(pull),
        "Push": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b""),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("raw.Rows", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file + ".tmp").write_text(str(port))
    os.replace(port_file + ".tmp", port_file)
    server.wait_for_termination()


class RawGrpc:
    """The client side, with the server started in a child process (a context manager)."""

    def __init__(self, row_bytes: int, workdir: Path) -> None:
        port_file = workdir / "raw_grpc.port"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--row-bytes", str(row_bytes), "--port-file", str(port_file)]
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("the raw gRPC server did not start")
            time.sleep(0.05)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}", options=OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.pull = self.channel.unary_unary("/raw.Rows/Pull")
        self.push = self.channel.unary_unary("/raw.Rows/Push")

    def __enter__(self) -> RawGrpc:
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row-bytes", type=int, required=True, help="bytes per row in Pull replies")
    parser.add_argument("--port-file", required=True, help="where to write the port once serving")
    args = parser.parse_args(argv)
    serve(args.row_bytes, args.port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
