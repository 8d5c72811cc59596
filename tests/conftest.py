"""Shared fixtures: real redis-server processes on free loopback ports (see redis_procs.py).

Servers are started once per session, and lazily: a test run that needs no Redis starts none.
Tests keep apart by namespace (`redis_namespace`), never by flushing a server.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import inspect
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ps_procs import embedded_client, embedded_ps, make_ps  # noqa: F401  (fixtures, for every module)
from redis_procs import RedisClusterProcesses, RedisProcess, find_binary, make_tls_files

if not torch.cuda.is_available():
    # Without a GPU the triton backend's kernels run under Triton's interpreter. Triton fixes the
    # mode when a kernel is decorated, at import, so it is set here, before any test module (or
    # a module it imports) brings in the triton kernels: set later, it came too late for them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


# Markers (registered in pyproject.toml) of tests in modules whose owners keep them apart
# from this file's edits; elsewhere a test carries its own @pytest.mark.slow / .dist.
_MARKED_HERE = {  # module: {test name pattern (fnmatch, with parameters): marker}
    "test_sharded_idtransformer.py": {"*": "dist"},
    "test_transform_stream.py": {"test_a_stream_agrees_with_transform_tables_on_every_rank*": "dist"},
    "test_kernel_build.py": {
        "test_a_second_checkout_of_the_same_source_reuses_the_build": "slow",
        "test_a_stale_build_lock_is_removed_not_waited_on": "slow",
    },
    "test_idtransformer.py": {
        "test_kernel_matches_the_torch_ops_on_a_large_aged_table*": "slow",
        "test_kernel_and_torch_backends_agree_call_by_call[[]torch]": "slow",
        "test_no_eviction_is_lost_across_pin_refusals*": "slow",
        "test_victims_under_a_sampled_bound_match_the_torch_ops*-large]": "slow",
    },
}
_CLUSTER_FIXTURES = {"redis_cluster", "redis_tls_cluster"}


def pytest_collection_modifyitems(config, items) -> None:
    """`cluster` on every test that starts a Redis Cluster (through its fixtures), the markers
    of _MARKED_HERE, `cuda` on every case parametrized with a CUDA device, `torchrec` on every
    test that needs TorchRec or fbgemm-gpu (below; only when -m asks about it); then, without a
    GPU, a skip on every `cuda` test (so `pytest -m cuda` selects the GPU checks, scripts/gpu_check.sh)."""
    asked = re.search(r"\btorchrec\b", config.getoption("markexpr", "") or "")
    for item in items:
        if asked and _needs_torchrec(item):
            item.add_marker(pytest.mark.torchrec)
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        for pattern, mark in _MARKED_HERE.get(item.path.name, {}).items():
            if fnmatch.fnmatchcase(item.name, pattern):
                item.add_marker(getattr(pytest.mark, mark))
        if _is_cuda_case(item):
            item.add_marker(pytest.mark.cuda)
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and not _cuda_available():
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _is_cuda_case(item) -> bool:
    """Whether a parameter of this case is a CUDA device: "cuda", "cuda:N" or a torch.device."""
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
            return True
        if type(value).__name__ == "device" and getattr(value, "type", None) == "cuda":
            return True
    return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- `torchrec`: the tests that need TorchRec or fbgemm-gpu -------------------------------------
# scripts/gpu_check.sh runs the CUDA tests that need neither first (`-m "cuda and not torchrec"`),
# so that a GPU run whose fbgemm-gpu did not arrive, or that is cut short, still tests the ID
# transformer, the row moves and the collectives. Read from the source, importing nothing: a test
# needs them when its module imports them (itself or through the checkout's modules it imports,
# at their top level), or its function or fixtures do, or what they name of the checkout
# (functions and classes: their own imports too, and what they name in turn), or a script or
# module of the checkout named in a string or parameter ("two_tower.py", "dynemb.trainer").
# Erring on the safe side: an import in a branch never taken counts. The marker is only worked
# out when -m names it (reading the checkout's source takes seconds), and under a -m that says
# "not torchrec" the test modules that cannot even be imported without them are not collected,
# so that their import errors do not fail a run where fbgemm-gpu is absent.

_NEEDS = frozenset({"torchrec", "fbgemm_gpu"})
_REPO = Path(__file__).resolve().parents[1]
# what using a function or class may run: (modules imported, the folder to find the suite's own
# modules from, the checkout's functions, classes and modules it names, files it runs or names)
_Facts = tuple[frozenset[str], Path, tuple[Any, ...], tuple[Path, ...]]
_FACTS: dict[Any, _Facts] = {}
_CLEAN: set[Any] = set()  # files, functions' code and classes from which neither can be reached


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if (
        collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and re.search(r"\bnot\s+torchrec\b", config.getoption("markexpr", "") or "")
        and _module_needs_torchrec(collection_path.resolve())
    ):
        return True
    return None


def _needs_torchrec(item) -> bool:
    try:
        return _item_needs_torchrec(item)
    except Exception:  # noqa: BLE001 - a reading this code cannot make must not stop a run: the safe side
        return True


def _item_needs_torchrec(item) -> bool:
    path = Path(item.path).resolve()
    if _module_needs_torchrec(path):
        return True
    objects = [getattr(item, "function", None)]
    for defs in getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values():
        objects += [d.func for d in defs]
    params = getattr(getattr(item, "callspec", None), "params", {}).values()
    files = [f for v in params if isinstance(v, str) for f in _named_files(v, path.parent)]
    return _reaches(files, [o for o in objects if o is not None])


@functools.cache
def _module_needs_torchrec(path: Path) -> bool:
    return _reaches([path], [])


def _reaches(files: list[Path], objects: list[Any]) -> bool:
    """Whether importing FILES or using OBJECTS (functions, classes) may import TorchRec or
    fbgemm-gpu. What a search that found neither went through is noted as clean, for the next."""
    seen_files: set[Path] = set()
    seen_objects: set[Any] = set()
    while files or objects:
        if files:
            path = files.pop()
            if path in seen_files or path in _CLEAN:
                continue
            seen_files.add(path)
            facts: _Facts = (_file_imports(path)[0], path.parent, (), ())
        else:
            obj = objects.pop()
            key = getattr(obj, "__code__", obj)
            if key in seen_objects or key in _CLEAN:
                continue
            seen_objects.add(key)
            facts = _object_facts(obj)
        names, near, refs, more = facts
        if any(name.split(".")[0] in _NEEDS for name in names):
            return True
        files += [f for name in names for f in _module_files(name, near)]
        files += more
        objects += refs
    _CLEAN.update(seen_files, seen_objects)
    return False


@functools.cache
def _parsed(path: Path) -> tuple[ast.Module, dict[str, ast.AST]]:
    """A file's syntax tree, and its functions and classes by __qualname__."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    index: dict[str, ast.AST] = {}

    def visit(body: list, prefix: str) -> None:  # statements only: no def is inside an expression
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + node.name
                index[name] = node
                visit(node.body, name + ("." if isinstance(node, ast.ClassDef) else ".<locals>."))
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []), prefix)

    visit(tree.body, "")
    return tree, index


@functools.cache
def _file_imports(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """The modules importing a file imports (dotted, absolute; not under `if TYPE_CHECKING:`,
    nor in functions), and its lazy names: the dict literals of name -> module of a package
    whose names are imported on first use (dynemb.common.lazy)."""
    tree = _parsed(path)[0]
    package = _package_of(path)
    names: set[str] = set()

    def visit(body: list) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update(_imported(node, package))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.stmt | ast.excepthandler)])

    visit(tree.body)
    lazy: dict[str, str] = {}  # from `NAME = {...}` at the top level
    for node in tree.body if package else []:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                key, value = getattr(k, "value", None), getattr(v, "value", None)
                if isinstance(key, str) and isinstance(value, str) and value.startswith(package.split(".")[0] + "."):
                    lazy[key] = value
    return frozenset(names), lazy


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement imports (a `from` one: the module, and each name
    as a submodule, which _module_files drops where there is none)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
        base = ".".join([*parts, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]


def _package_of(path: Path) -> str:
    """The dotted package a file of the checkout is in ("" for the suite's own files)."""
    try:
        parts = path.relative_to(_REPO).parent.parts
    except ValueError:
        return ""
    return ".".join(parts) if parts and (_REPO / parts[0] / "__init__.py").is_file() else ""


@functools.cache
def _module_files(name: str, near: Path) -> tuple[Path, ...]:
    """The checkout's files that importing NAME runs (each package on the way), beside NEAR, in
    the checkout, or on sys.path inside it (the suite's folders); a lazy name of a package
    (`from dynemb.tables import shard_model`) gives the module it comes from."""
    parts = name.split(".")
    roots = [near, _REPO, *(Path(p) for p in sys.path if p.startswith(str(_REPO)) and ".venv" not in p)]
    found: list[Path] = []
    for i in range(1, len(parts) + 1):
        file = next((f for r in roots if (f := _module_file(r, tuple(parts[:i])))), None)
        if file is None:
            if found and parts[i - 1] in (lazy := _file_imports(found[-1])[1]):
                found += _module_files(lazy[parts[i - 1]], near)
            break
        found.append(file)
    return tuple(found)


@functools.cache
def _module_file(root: Path, parts: tuple[str, ...]) -> Path | None:
    path = root.joinpath(*parts)
    for f in (path.with_suffix(".py"), path / "__init__.py"):
        if f.is_file():
            return f.resolve()
    return None


@functools.cache
def _named_files(text: str, near: Path) -> tuple[Path, ...]:
    """A script ("two_tower.py") or module ("dynemb.trainer": its __main__ too) of the checkout
    that TEXT names; () for any other string."""
    if text.endswith(".py") and re.fullmatch(r"[\w./-]+", text):
        for f in (near / text, _REPO / text, *_REPO.glob(f"*/{text}"), *(_REPO / "tests").glob(f"**/{text}")):
            if f.is_file():
                return (f.resolve(),)
    elif re.fullmatch(r"dynemb(\.\w+)*", text):
        main = _module_file(_REPO, (*text.split("."), "__main__"))
        return _module_files(text, _REPO) + ((main,) if main else ())
    return ()


@functools.cache
def _module_path(name: str) -> Path | None:
    """The file of an imported module of the checkout; None for any other."""
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    return path if path.is_relative_to(_REPO) and ".venv" not in path.parts else None


def _in_repo(obj: Any) -> bool:
    if inspect.ismodule(obj):
        return _module_path(obj.__name__) is not None
    return (inspect.isfunction(obj) or inspect.isclass(obj)) and _module_path(obj.__module__) is not None


def _object_facts(obj: Any) -> _Facts:
    """What using a function or class of the checkout may run (_Facts)."""
    key = getattr(obj, "__code__", obj)
    try:
        return _FACTS[key]
    except (KeyError, TypeError):
        pass
    module_name = getattr(obj, "__module__", None) or ""
    path = _module_path(module_name)
    node = _parsed(path)[1].get(getattr(obj, "__qualname__", "")) if path else None
    if path is None or node is None:
        return (frozenset(), _REPO, (), ())
    namespace = vars(sys.modules[module_name])
    package = _package_of(path)
    names: set[str] = set()
    refs: list[Any] = []
    files: set[Path] = {path}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import | ast.ImportFrom):
            imported = _imported(sub, package)
            names.update(imported)
            if isinstance(sub, ast.ImportFrom) and (source := sys.modules.get(imported[0])):
                refs += [vars(source).get(alias.name) for alias in sub.names]
        elif isinstance(sub, ast.Attribute | ast.Name) and isinstance(sub.ctx, ast.Load):
            chain = []
            while isinstance(sub, ast.Attribute):
                chain.append(sub.attr)
                sub = sub.value
            if isinstance(sub, ast.Name):
                value = namespace.get(sub.id)
                refs.append(value)
                for attr in reversed(chain):  # a.b.c: through the checkout's modules only
                    if not (inspect.ismodule(value) and _in_repo(value)):
                        break
                    if attr not in vars(value) and attr in (lazy := _file_imports(_module_path(value.__name__))[1]):
                        names.add(lazy[attr])
                    value = vars(value).get(attr)
                    refs.append(value)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            files.update(_named_files(sub.value, path.parent))
    facts = (frozenset(names), path.parent, tuple(r for r in refs if _in_repo(r)), tuple(files))
    try:
        _FACTS[key] = facts
    except TypeError:
        pass
    return facts
