"""Real redis-server processes for tests, benchmarks and demos: standalone (plain, ACL/password,
TLS), a Cluster of masters (with replicas, if asked), and a replicated standalone Redis watched
by Sentinel.

Each server gets a free loopback port, its own temp dir and a config file there (no
persistence: `save ""`, `appendonly no`), and is terminated by `stop()`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from dynemb.testing.process import TempDirProcess, end_process

REPO = Path(__file__).resolve().parents[2]
SETUP_HINT = "run scripts/setup_env.sh (it puts redis-server and redis-cli in .bin/), or set DYNEMB_REDIS_SERVER"


def find_binary(name: str = "redis-server") -> str:
    """DYNEMB_REDIS_SERVER (redis-cli: next to it), else the repo's .bin/, else PATH."""
    env = os.environ.get("DYNEMB_REDIS_SERVER")
    candidates: list[str | None] = []
    if env:
        candidates.append(env if name == "redis-server" else str(Path(env).with_name(name)))
    candidates += [str(REPO / ".bin" / name), shutil.which(name)]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(f"no {name} binary found (tried {[c for c in candidates if c]}): {SETUP_HINT}")


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before in this process (a node needs two)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class RedisProcess(TempDirProcess):
    """One redis-server. `config` lines are added to the generated redis.conf.

    `client_kwargs` are what a redis-py client needs to reach it (TLS, password), used to
    wait for it to answer. The port stays the same across stop()/start(), so a restarted
    server is at the same URL; its dir too, so a dump.rdb written by SAVE is loaded again.
    """

    def __init__(
        self,
        config: Sequence[str] = (),
        *,
        tls: bool = False,
        unix_socket: bool = False,
        client_kwargs: dict | None = None,
    ) -> None:
        self.port = free_port()
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix="dynemb-redis-test-")
        self.config = list(config)
        keys = {line.split()[0] for line in self.config if line.split()}
        if "cluster-enabled" in keys and "cluster-port" not in keys:
            # a cluster node's bus defaults to port + 10000, which may be taken or past 65535
            self.config.append(f"cluster-port {free_port()}")
        # also listen on <dir>/redis.sock (a short path: sun_path holds ~107 bytes)
        self.unix_socket = os.path.join(self.dir, "redis.sock") if unix_socket else None
        if self.unix_socket:
            self.config += [f"unixsocket {self.unix_socket}", "unixsocketperm 700"]
        self.client_kwargs = dict(client_kwargs or {})
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        """The loopback address it listens on."""
        return "127.0.0.1"

    @property
    def address(self) -> str:
        """host:port."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Its redis:// (rediss:// with TLS) URL, database 0."""
        return f"{'rediss' if self.tls else 'redis'}://{self.address}/0"

    @property
    def log_path(self) -> str:
        """Where the server logs, in its folder."""
        return os.path.join(self.dir, "redis.log")

    def log(self) -> str:
        """The last 4000 characters of its log; empty if it cannot be read."""
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def start(self, timeout: float = 15.0) -> RedisProcess:
        """Start it and wait until it answers PING; a server that fails to start is cleaned up."""
        port_lines = ["port 0", f"tls-port {self.port}"] if self.tls else [f"port {self.port}"]
        lines = [
            *port_lines,
            "bind 127.0.0.1",
            'save ""',
            "appendonly no",
            f"dir {self.dir}",
            f"logfile {self.log_path}",
            *self.config,
        ]
        conf = os.path.join(self.dir, "redis.conf")
        Path(conf).write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([find_binary(), conf], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, **kw) -> redis.Redis:
        """A redis-py client for it, with client_kwargs (and kw over them)."""
        return redis.Redis(host=self.host, port=self.port, ssl=self.tls, **{**self.client_kwargs, **kw})

    def wait_ready(self, timeout: float) -> None:
        """Wait until the started server answers PING.

        Raises:
            RuntimeError: it was not started, exited, or did not answer within timeout seconds.
        """
        proc = self.proc
        if proc is None:
            raise RuntimeError(f"redis-server on {self.address} is not started: call start(), not wait_ready()")
        deadline = time.monotonic() + timeout
        client = self.client(socket_connect_timeout=0.5, socket_timeout=2)
        try:
            while True:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError) as exc:  # BusyLoadingError too
                    if proc.poll() is not None:
                        raise RuntimeError(f"redis-server on {self.address} exited at start:\n{self.log()}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server on {self.address} did not answer PING in {timeout}s ({exc}):\n{self.log()}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def wait_synced(self, deadline: float) -> None:
        """Wait until this replica's link to its master is up (its first copy loaded).

        Raises:
            RuntimeError: not by deadline (time.monotonic() seconds).
        """
        c = self.client(socket_timeout=2)
        try:
            while c.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {self.address} never synced with its master:\n{self.log()}")
                time.sleep(0.05)
        finally:
            c.close()

    def stop(self) -> None:
        """Terminate the server (its folder and port stay for a restart)."""
        if self.proc is not None:
            end_process(self.proc)
        self.proc = None


class RedisClusterProcesses:
    """A Redis Cluster of `masters` masters, each with `replicas` replicas, on loopback, made with
    `redis-cli --cluster create`.

    With `tls_files` (from make_tls_files) clients and the cluster bus use TLS only.
    `node_timeout_ms` is cluster-node-timeout: how long a master may be unreachable before its
    replica is promoted (failover tests make it short).
    """

    def __init__(
        self,
        masters: int = 3,
        tls_files: dict[str, str] | None = None,
        acl: tuple[str, str] | None = None,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 5000,
    ) -> None:
        self.tls_files = tls_files
        self.acl = acl
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        client_kwargs: dict = {}
        extra_config: list[str] = []
        if acl:  # a user with every right; the default user is locked out
            extra_config += [f"user {acl[0]} on >{acl[1]} ~* &* +@all", "user default off"]
            client_kwargs.update(username=acl[0], password=acl[1])
        if tls_files:  # clients and the cluster bus both over TLS
            extra_config += [
                f"tls-cert-file {tls_files['cert']}",
                f"tls-key-file {tls_files['key']}",
                f"tls-ca-cert-file {tls_files['ca']}",
                "tls-auth-clients no",
                "tls-cluster yes",
            ]
            client_kwargs["ssl_ca_certs"] = tls_files["ca"]
        self._extra_config = extra_config
        self._client_kwargs = client_kwargs
        self.nodes = [self._new_node() for _ in range(masters * (1 + replicas))]

    def _new_node(self) -> RedisProcess:
        # the cluster bus port is chosen too, so it need not be port + 10000
        return RedisProcess(
            [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                f"cluster-port {free_port()}",
                f"cluster-node-timeout {self.node_timeout_ms}",
                # a replica cut off for long may still be promoted: the failover tests stop one on purpose
                "cluster-replica-validity-factor 0",
                "repl-diskless-sync-delay 0",  # a replica's first sync at once, not after 5 s
                *self._extra_config,
            ],
            tls=bool(self.tls_files),
            client_kwargs=self._client_kwargs,
        )

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """`redis-cli <args>` with the cluster's TLS and user options; its output captured, not checked."""
        cmd = [find_binary("redis-cli"), *args]
        if self.tls_files:
            cmd += ["--tls", "--cacert", self.tls_files["ca"]]
        if self.acl:
            cmd += ["--user", self.acl[0], "--pass", self.acl[1], "--no-auth-warning"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def add_master(self, timeout: float = 30.0) -> RedisProcess:
        """Start one more node and join it as a master with no slots (`redis-cli --cluster add-node`);
        returns it once every node knows it. Moving slots to it is the caller's (reshard, rebalance).

        Raises:
            RuntimeError: the node did not start or join, or the nodes did not agree on it in time.
        """
        node = self._new_node()
        self.nodes.append(node)
        node.start()
        done = self.cli("--cluster", "add-node", node.address, self.nodes[0].address, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster add-node {node.address} failed:\n{done.stdout}\n{done.stderr}")
        # redis-cli's reshard and rebalance refuse to run until the nodes agree on the
        # configuration, and the new node refuses MIGRATE (CLUSTERDOWN) until it sees every slot
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            c = n.client()
            try:
                while True:
                    info = c.cluster("INFO")
                    if info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(self.nodes):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {n.address} never saw the new node {node.address}")
                    time.sleep(0.1)
            finally:
                c.close()
        return node

    @property
    def addresses(self) -> list[str]:
        """host:port of every node."""
        return [n.address for n in self.nodes]

    @property
    def url(self) -> str:
        """Its redis+cluster:// (rediss+cluster:// with TLS) URL, every node listed."""
        return f"{'rediss' if self.tls_files else 'redis'}+cluster://" + ",".join(self.addresses)

    def start(self, timeout: float = 30.0) -> RedisClusterProcesses:
        """Start every node, create the cluster and wait until each node reports it ok; returns self.

        Raises:
            RuntimeError: a node, `redis-cli --cluster create` or the cluster failed (the nodes are closed then).
        """
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for n in self.nodes:
            n.start()
        args = ["--cluster", "create", *self.addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = self.cli(*args, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            c = n.client()
            try:
                while c.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {n.address} never reached cluster_state:ok:\n{n.log()}")
                    time.sleep(0.1)
            finally:
                c.close()
        if self.replicas:
            self.wait_replicated(timeout)

    def roles(self) -> dict[str, str | None]:
        """Each running node's address -> the address of the master it replicates, or None for
        a master, as the nodes report it now (ROLE)."""
        out: dict[str, str | None] = {}
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            c = n.client(socket_timeout=2)
            try:
                role = c.execute_command("ROLE")
            except redis.RedisError:
                continue
            finally:
                c.close()
            kind = role[0].decode() if isinstance(role[0], bytes) else role[0]
            if kind == "master":
                out[n.address] = None
            else:
                host = role[1].decode() if isinstance(role[1], bytes) else role[1]
                out[n.address] = f"{host}:{role[2]}"
        return out

    def node(self, address: str) -> RedisProcess:
        """The node at host:port."""
        return next(n for n in self.nodes if n.address == address)

    def replica_of(self, master: RedisProcess) -> RedisProcess:
        """A running node that replicates master now."""
        for address, of in self.roles().items():
            if of == master.address:
                return self.node(address)
        raise RuntimeError(f"no node replicates {master.address}")

    def wait_replicated(self, timeout: float = 30.0) -> None:
        """Wait until every replica's link to its master is up (its first sync done).

        Raises:
            RuntimeError: one was not in sync after timeout seconds.
        """
        deadline = time.monotonic() + timeout
        for address, of in self.roles().items():
            if of is not None:
                self.node(address).wait_synced(deadline)

    def wait_promoted(self, replica: RedisProcess, timeout: float = 30.0) -> None:
        """Wait until replica is a master and the live nodes say the cluster is ok.

        Raises:
            RuntimeError: it was not promoted in time.
        """
        deadline = time.monotonic() + timeout
        while self.roles().get(replica.address, "") is not None or not self._ok(replica):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica.address} was not promoted in {timeout}s:\n{replica.log()}")
            time.sleep(0.1)

    @staticmethod
    def _ok(node: RedisProcess) -> bool:
        c = node.client(socket_timeout=2)
        try:
            return c.cluster("INFO").get("cluster_state") == "ok"
        except redis.RedisError:
            return False
        finally:
            c.close()

    def close(self) -> None:
        """Stop every node and remove its folder."""
        for n in self.nodes:
            n.close()


class SentinelProcess(RedisProcess):
    """One redis-server in Sentinel mode watching the master `name` at master_address, with a
    quorum of `quorum` and the given down-after and failover timeouts (short in tests)."""

    def __init__(
        self, name: str, master_address: str, *, quorum: int = 1, down_after_ms: int = 1000, failover_ms: int = 3000
    ) -> None:
        host, port = master_address.rsplit(":", 1)
        super().__init__(
            [
                f"sentinel monitor {name} {host} {port} {quorum}",
                f"sentinel down-after-milliseconds {name} {down_after_ms}",
                f"sentinel failover-timeout {name} {failover_ms}",
                f"sentinel parallel-syncs {name} 1",
            ]
        )

    def start(self, timeout: float = 15.0) -> SentinelProcess:
        """Start it (it rewrites its own config file, so the file is its own) and wait for PING."""
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}", f"logfile {self.log_path}", *self.config]
        conf = os.path.join(self.dir, "sentinel.conf")
        Path(conf).write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            [find_binary(), conf, "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self


class RedisSentinelProcesses:
    """A standalone Redis master with `replicas` replicas and `sentinels` Sentinels watching it
    under the name `name`; Sentinel promotes a replica when the master has not answered for
    down_after_ms. `url` is the redis+sentinel:// URL a PS takes."""

    def __init__(
        self, replicas: int = 1, sentinels: int = 1, *, name: str = "dynemb", down_after_ms: int = 1000
    ) -> None:
        self.name = name
        self.nodes = [RedisProcess(["repl-diskless-sync-delay 0"])]  # replicas sync at once, not after 5 s
        master = self.nodes[0]
        self.nodes += [RedisProcess([f"replicaof {master.host} {master.port}"]) for _ in range(replicas)]
        quorum = sentinels // 2 + 1
        self.sentinels = [
            SentinelProcess(name, master.address, quorum=quorum, down_after_ms=down_after_ms) for _ in range(sentinels)
        ]

    @property
    def url(self) -> str:
        """redis+sentinel://<sentinels>/<name>."""
        return "redis+sentinel://" + ",".join(s.address for s in self.sentinels) + f"/{self.name}"

    def master(self) -> RedisProcess:
        """The node the Sentinels name as master now."""
        c = self.sentinels[0].client(socket_timeout=2)
        try:
            host, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.name)
        finally:
            c.close()
        host = host.decode() if isinstance(host, bytes) else host
        return next(n for n in self.nodes if n.address == f"{host}:{port}")

    def start(self, timeout: float = 30.0) -> RedisSentinelProcesses:
        """Start the master, its replicas (waiting until they synced) and the Sentinels (waiting
        until each sees every replica); returns self.

        Raises:
            RuntimeError: a process failed to start, or did not sync or see the replicas in time.
        """
        try:
            for n in self.nodes:
                n.start()
            deadline = time.monotonic() + timeout
            for n in self.nodes[1:]:
                n.wait_synced(deadline)
            for s in self.sentinels:
                s.start()
                c = s.client(socket_timeout=2)
                try:
                    while len(c.sentinel_slaves(self.name)) < len(self.nodes) - 1:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"sentinel {s.address} never saw the replicas:\n{s.log()}")
                        time.sleep(0.1)
                finally:
                    c.close()
        except BaseException:
            self.close()
            raise
        return self

    def wait_promoted(self, old: RedisProcess, timeout: float = 30.0) -> RedisProcess:
        """Wait until the Sentinels name a master other than old, and it says it is one.

        Raises:
            RuntimeError: no failover in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError, StopIteration):
                new = self.master()
                if new is not old:
                    c = new.client(socket_timeout=2)
                    try:
                        if c.info("replication").get("role") == "master":
                            return new
                    finally:
                        c.close()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no replica of {old.address} was promoted in {timeout}s:\n{self.sentinels[0].log()}"
                )
            time.sleep(0.1)

    def close(self) -> None:
        """Stop every process and remove its folder."""
        for p in [*self.sentinels, *self.nodes]:
            p.close()


def make_tls_files(directory: str) -> dict[str, str]:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1 (trustme), as PEM files."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    paths = {
        "ca": os.path.join(directory, "ca.pem"),
        "cert": os.path.join(directory, "server.pem"),
        "key": os.path.join(directory, "server.key"),
    }
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(paths["cert"], append=True)
    cert.private_key_pem.write_to_path(paths["key"])
    return paths
