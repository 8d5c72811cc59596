"""Shared fixtures: real redis-server processes on free loopback ports (see redis_procs.py).

Servers are started once per session, and lazily: a test run that needs no Redis starts none.
Tests keep apart by namespace (`redis_namespace`), never by flushing a server.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

# One intra-op thread in every test process and in what it starts (the variable is inherited):
# the suite runs 2 workers a core, each starting trainers, ranks and servers, and torch's
# OpenMP threads, two a process, then spin against each other. Set before torch is imported
# (it reads the variable then); a 100-step test job took 10-20 s with them on the loaded box,
# 0.5 s without.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from ps_procs import embedded_client, embedded_ps, make_ps  # noqa: F401  (fixtures, for every module)
from redis_procs import RedisClusterProcesses, RedisProcess, find_binary, make_tls_files

torch.set_num_threads(1)  # (should torch have been imported before this file, by a plugin)

pytest_plugins = ["cpu_report"]  # --cpu-report FILE: where the suite's CPU goes

if not torch.cuda.is_available():
    # Without a GPU the triton backend's kernels run under Triton's interpreter. Triton fixes the
    # mode when a kernel is decorated, at import, so it is set here, before any test module (or
    # a module it imports) brings in the triton kernels: set later, it came too late for them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        help="the release check's counts where a test has two (the PS fuzz: 10,000 hostile requests a run, not 2,000)",
    )


@pytest.fixture(scope="session")
def soak(request) -> bool:
    """Whether the run is the release check's (--soak): the longer counts."""
    return bool(request.config.getoption("--soak"))


@pytest.fixture(scope="session")
def redis_binaries() -> tuple[str, str]:
    """(redis-server, redis-cli); fails the test (never skips) when they are missing."""
    try:
        return find_binary("redis-server"), find_binary("redis-cli")
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_server(redis_binaries):
    """A plain standalone redis-server, also on a unix socket (`redis_server.unix_socket`)."""
    proc = RedisProcess(unix_socket=True).start()
    yield proc
    proc.close()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def own_redis_url(redis_binaries):
    """A redis-server for this test alone, for tests that count the server's commands:
    commandstats counts every client's, and a sweeper or PS thread an earlier test on this
    worker left winding down would add to the shared server's."""
    with RedisProcess() as proc:
        yield proc.url


@pytest.fixture
def redis_namespace() -> str:
    """A namespace no other test uses, so tests sharing a server never see each other's tables."""
    return f"t{uuid.uuid4().hex[:12]}"


@dataclass
class AuthRedis:
    """A server with `requirepass` (the default user) and an ACL user."""

    proc: RedisProcess
    user: str
    password: str
    default_password: str

    @property
    def address(self) -> str:
        return self.proc.address

    def url_for(self, user: str | None, password: str | None) -> str:
        """redis://[user:password@]host:port/0 with the parts percent-encoded."""
        from urllib.parse import quote

        creds = ""
        if password is not None:
            creds = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
        return f"redis://{creds}{self.address}/0"

    @property
    def url(self) -> str:
        return self.url_for(self.user, self.password)


@pytest.fixture(scope="module")
def one_process_group():
    """A process group of this one process (gloo), for code that makes collective calls."""
    import torch.distributed as dist

    from dynemb.trainer.train import init_distributed

    created = init_distributed()
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def redis_auth(redis_binaries):
    user, password, default_password = "dynemb_ps", "p@ss:w/rd-42", "default-secret"
    proc = RedisProcess(
        [f"requirepass {default_password}", f"user {user} on >{password} ~* &* +@all"],
        client_kwargs={"username": user, "password": password},
    ).start()
    yield AuthRedis(proc, user, password, default_password)
    proc.close()


@dataclass
class TlsRedis:
    proc: RedisProcess
    ca_file: str

    @property
    def url(self) -> str:
        return self.proc.url  # rediss://127.0.0.1:port/0


@pytest.fixture(scope="session")
def redis_tls(redis_binaries, tmp_path_factory):
    """A TLS-only server (no plain port) with a certificate from a throwaway CA (trustme)."""
    files = make_tls_files(str(tmp_path_factory.mktemp("redis-tls")))
    proc = RedisProcess(
        [
            f"tls-cert-file {files['cert']}",
            f"tls-key-file {files['key']}",
            f"tls-ca-cert-file {files['ca']}",
            "tls-auth-clients no",
        ],
        tls=True,
        client_kwargs={"ssl_ca_certs": files["ca"]},
    ).start()
    yield TlsRedis(proc, files["ca"])
    proc.close()


@pytest.fixture(scope="session")
def redis_cluster(redis_binaries):
    """A real 3-master Redis Cluster on loopback; `.url` is redis+cluster://h:p,h:p,h:p."""
    cluster = RedisClusterProcesses(masters=3).start()
    yield cluster
    cluster.close()


@dataclass
class TlsAclCluster:
    cluster: RedisClusterProcesses
    ca_file: str
    user: str
    password: str

    def url_for(self, user: str, password: str) -> str:
        """rediss+cluster://user:password@h:p,h:p,h:p?ssl_ca_certs=CA (parts percent-encoded)."""
        from urllib.parse import quote

        creds = f"{quote(user, safe='')}:{quote(password, safe='')}"
        nodes = ",".join(self.cluster.addresses)
        return f"rediss+cluster://{creds}@{nodes}?ssl_ca_certs={quote(self.ca_file)}"

    @property
    def url(self) -> str:
        return self.url_for(self.user, self.password)


@pytest.fixture(scope="session")
def redis_tls_cluster(redis_binaries, tmp_path_factory):
    """A 3-master Cluster speaking TLS only (clients and cluster bus) that lets in one ACL user."""
    files = make_tls_files(str(tmp_path_factory.mktemp("redis-tls-cluster")))
    user, password = "dynemb_ps", "cl@ster:pw"
    cluster = RedisClusterProcesses(masters=3, tls_files=files, acl=(user, password)).start()
    yield TlsAclCluster(cluster, files["ca"], user, password)
    cluster.close()


@pytest.fixture
def redis_process(redis_binaries):
    """Factory for extra standalone servers a test may stop and restart; all stopped at its end."""
    made: list[RedisProcess] = []

    def make(config: list[str] = ()) -> RedisProcess:
        proc = RedisProcess(config)
        made.append(proc)
        return proc.start()

    yield make
    for proc in made:
        proc.close()


_CLUSTER_FIXTURES = {"redis_cluster", "redis_tls_cluster"}


def pytest_collection_modifyitems(config, items) -> None:
    """`cluster` on every test that starts a Redis Cluster (through its fixtures), `cuda` on
    every case parametrized with a CUDA device; then, without a GPU, a skip on every `cuda` test
    (so `pytest -m cuda` selects the GPU checks, scripts/gpu_check.sh); then the order. The other
    markers are written on the tests themselves."""
    for item in items:
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        if _is_cuda_case(item):
            item.add_marker(pytest.mark.cuda)
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and not torch.cuda.is_available():
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    # the longest first (torchrun jobs, then other slow tests), each kind in the seed's order:
    # pytest-xdist hands tests out in this order, so that no worker starts a minute-long test
    # while the others have run out of work (a stable sort keeps pytest-randomly's order)
    items.sort(key=lambda item: 0 if item.get_closest_marker("dist") else 1 if _is_slow(item) else 2)


def _is_slow(item) -> bool:
    return any(item.get_closest_marker(name) for name in ("slow", "cluster"))


def _is_cuda_case(item) -> bool:
    """Whether a parameter of this case is a CUDA device: "cuda", "cuda:N" or a torch.device."""
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
            return True
        if isinstance(value, torch.device) and value.type == "cuda":
            return True
    return False


# A module whose every test needs TorchRec or fbgemm-gpu says so at its top level
# (`pytestmark = pytest.mark.torchrec`), and may import them there. Under a -m that says
# "not torchrec" (scripts/gpu_check.sh runs "cuda and not torchrec" first, so that a GPU machine
# whose fbgemm-gpu did not arrive still tests the rest) such a module is not even collected:
# importing it could fail. tests/test_suite_layout.py checks that every other module imports.
_MODULE_MARKS = re.compile(r"^pytestmark = (\[[^\]]*\]|[^\n]*)", re.M)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if (
        collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and re.search(r"\bnot\s+torchrec\b", config.getoption("markexpr", "") or "")
        and any("pytest.mark.torchrec" in m for m in _MODULE_MARKS.findall(collection_path.read_text()))
    ):
        return True
    return None


# --- pytest-xdist: which worker runs what (scripts/test.sh runs -n N --dist load) --------------
# Tests are handed out one at a time in the order above, except the tests of these modules,
# which share a module-scoped fixture that costs tens of seconds (a Prometheus stack and the
# trainers it scrapes, a torchrun job, a training run, a kernel build): each module goes to one
# worker whole, which sets its fixture up once. Written here by hand because xdist's own groups
# (--dist loadgroup) rename node ids, which pytest 9 no longer lets a plugin do.
_ONE_WORKER_MODULES = frozenset(
    {
        "test_prometheus.py",
        "test_communicators.py",
        "test_checkpoint_cli.py",
        "test_trainer_counters.py",
        "test_kernel_build.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would answer for --dist load
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATime(LoadScopeScheduling):
        """LoadScopeScheduling with a unit of one test, or of one module of _ONE_WORKER_MODULES:
        units are handed out in the suite's order (the modules first, largest first), a worker
        given one more when it has two tests or fewer left."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in _ONE_WORKER_MODULES else nodeid

    return OneAtATime(config, log)
