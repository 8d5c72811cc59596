#!/usr/bin/env bash
# Run HERE, where PyPI is reachable: fetch the Python 3.12 x86-64 wheels the GPU host lacks (it
# has torch, triton and CuPy, but no torchrec, no fbgemm-gpu and no network), and lay them out
# in carry-sized groups for the device tool, whose calls take 64 MiB each (the working tree
# included). docs/gpu.md says how a session carries them; scripts/gpu_check.sh installs them there.
#
#   scripts/gpu_wheels.sh                  # download, then lay out .whl/ and write .whl/plan.txt
#   scripts/gpu_wheels.sh --no-download    # lay out again from what .whl/download holds
#   options: --dir DIR (default .whl)  --piece-size SIZE (default 55M)  --group-size SIZE (default 60M)
#            --wheel NAME==VERSION (repeated: these in place of the list below)  --no-debs
#
# Layout (all git-ignored):
#   .whl/download/  the wheels as PyPI serves them; kept, so a second run downloads nothing
#   .whl/small/     the wheels under --piece-size, redis-server's .debs, and pieces.sha256:
#                   what the first device call carries, with the tree
#   .whl/pieces/    each larger wheel re-packed as <wheel>.tar.xz and cut into <wheel>.tar.xz.part-NN
#   .whl/plan.txt   the carry groups, one line per device call, in order
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# One version of each (two stop pip's install there). Why each one travels:
WHEELS=(
  fbgemm-gpu==1.6.0             # the CUDA 13 build on PyPI, for the host's torch 2.11 (~465 MB)
  torchrec==1.6.1               # the release for torch 2.11 / fbgemm-gpu 1.6
  tensordict==0.15.3            # torchrec needs it; this one asks for torch>=2.11
  pyvers==0.2.3                 # tensordict imports it
  iopath==0.1.9                 # torchrec.datasets.utils imports it at load (dynemb imports Batch from there)
  torchmetrics==1.0.3           # torchrec pins it; the host has 1.9
  grpcio==1.85.1                # the generated ps_pb2_grpc.py refuses an older grpcio; the host's version is unknown
  grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1
  protobuf==7.36.2              # the generated *_pb2.py need a 7.x runtime >= 7.35.1
  redis==8.1.0
  hiredis==3.5.0
  google-crc32c==1.9.0
  pytest-randomly==5.1.0        # pyproject's addopts pass --randomly-seed: pytest stops without the plugin
  trustme==1.2.1                # two test modules import it at load; without it their collection fails
  cryptography==50.0.2          # trustme's
  cffi==2.1.1                   # cryptography's
  pycparser==3.12               # cffi's
)
# redis-server for the tests' fixtures: Debian 12's 7.0 build, unpacked there with dpkg -x.
DEBS=(redis-tools libjemalloc2 liblzf1)
# The tags pip may take for the host (device/README.md): CPython 3.12 on x86-64 glibc.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)
CALL_LIMIT=$((64 * 1024 * 1024))  # the device tool's limit per call: tree + carried paths
# -9e packs fbgemm-gpu 1.6.0 into 154 MB, 3 calls, where -6 gives 176 MB, 4 calls; it takes ~2x
# as long (25 minutes on 2 busy cores, once: the tar.xz is kept), and unpacks as fast.
XZ_LEVEL=-9e

DIR=.whl
DOWNLOAD=1
WITH_DEBS=1
PIECE_SIZE=55M
GROUP_SIZE=60M

die() { echo "gpu_wheels: $*" >&2; exit 1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
size_of() { du -sb "$1" | cut -f1; }

parse_args() {
  while [ $# -gt 0 ]; do
    case $1 in
      --no-download) DOWNLOAD= ;;
      --no-debs) WITH_DEBS= ;;
      --wheel)
        [[ ${2:-} == ?*==?* ]] || die "--wheel takes NAME==VERSION, not '${2:-}'"
        [ -n "${CHOSEN:-}" ] || { WHEELS=(); CHOSEN=1; }
        WHEELS+=("$2")
        shift
        ;;
      --dir) DIR=${2:?--dir needs a folder}; shift ;;
      --piece-size) PIECE_SIZE=${2:?--piece-size needs a size such as 55M}; shift ;;
      --group-size) GROUP_SIZE=${2:?--group-size needs a size such as 60M}; shift ;;
      -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
  done
  PIECE_BYTES=$(numfmt --from=iec "$PIECE_SIZE") || die "--piece-size '$PIECE_SIZE' is not a size (e.g. 55M)"
  GROUP_BYTES=$(numfmt --from=iec "$GROUP_SIZE") || die "--group-size '$GROUP_SIZE' is not a size (e.g. 60M)"
  [ "$PIECE_BYTES" -le "$GROUP_BYTES" ] || die "--piece-size ($PIECE_SIZE) must not exceed --group-size ($GROUP_SIZE)"
}

# pip of the project's .venv where there is one (any Python can download for 3.12).
pip_python() {
  if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo "${PYTHON:-python3}"; fi
}

download_wheels() {
  local plat=() p
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  mkdir -p "$DIR/download"
  echo "[gpu_wheels] downloading ${#WHEELS[@]} wheels for CPython 3.12 x86-64 into $DIR/download"
  "$(pip_python)" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${plat[@]}" -d "$DIR/download" "${WHEELS[@]}"
}

# The downloaded file of NAME==VERSION (wheel names spell the project with '_', any case).
wheel_file() {
  local name=${1%%==*} version=${1##*==} f
  name=${name//-/_}
  name=${name,,}
  for f in "$DIR/download"/*.whl; do
    f=${f##*/}
    if [[ ${f,,} == "$name-$version-"*.whl ]]; then echo "$DIR/download/$f"; return 0; fi
  done
  return 1
}

# Debian's redis-server: from setup_env.sh's .bin/debs when it fetched them, else apt-get download
# with lists and cache of our own (no root needed). Saved as NAME.deb: plain names travel safely.
fetch_debs() {
  local pkg f cache=$DIR/apt
  for pkg in "${DEBS[@]}"; do
    f=$(ls .bin/debs/"${pkg}"_*.deb 2>/dev/null | head -1 || true)
    if [ -z "$f" ] && command -v apt-get >/dev/null; then
      local opts=(-q -o Dir::State::Lists="$ROOT/$cache/lists" -o Dir::Cache="$ROOT/$cache/cache" -o Debug::NoLocking=1)
      mkdir -p "$cache/lists/partial" "$cache/cache/archives/partial" "$cache/debs"
      [ -n "$(ls "$cache/lists" 2>/dev/null | grep -v partial || true)" ] || apt-get "${opts[@]}" update >/dev/null 2>&1 || true
      (cd "$cache/debs" && apt-get "${opts[@]}" download "$pkg" >/dev/null 2>&1) || true
      f=$(ls "$cache/debs/${pkg}"_*.deb 2>/dev/null | head -1 || true)
    fi
    if [ -n "$f" ]; then
      cp "$f" "$DIR/small/$pkg.deb"
    else
      echo "[gpu_wheels] WARNING: no $pkg .deb (no .bin/debs, no apt-get): tests that start Redis fail there" >&2
    fi
  done
}

# Re-pack one wheel as $DIR/download/<wheel>.tar.xz (kept: a second run reuses it). Why: a wheel
# is a deflate zip, and xz packs fbgemm-gpu's CUDA libraries 3x smaller (465 -> 154 MB), which
# saves device calls. The host unpacks the tar into its --target folder, as pip would write it.
repack_wheel() {
  local whl=$1 name tarxz from
  name=$(basename "$whl")
  tarxz=$DIR/download/$name.tar.xz
  from="$(sha256sum "$whl" | cut -d' ' -f1) xz $XZ_LEVEL"
  if [ "$(cat "$tarxz.from" 2>/dev/null)" != "$from" ]; then
    echo "[gpu_wheels] re-packing $name ($(mib "$(size_of "$whl")")) as tar.xz"
    rm -rf "$WORK/tree" && mkdir -p "$WORK/tree"
    unzip_keeping_modes "$whl" "$WORK/tree"
    # multi-threaded xz writes independent blocks, which a multi-threaded xz can also unpack
    tar -C "$WORK/tree" --owner=0 --group=0 -cf - . | nice xz "$XZ_LEVEL" -T0 >"$tarxz.tmp"
    rm -rf "$WORK/tree"
    # every file of the wheel in the tar, each matching the wheel's own RECORD
    check_record "$name" <"$tarxz.tmp"
    mv "$tarxz.tmp" "$tarxz" && echo "$from" >"$tarxz.from"
  fi
  echo "$(sha256sum "$tarxz" | cut -d' ' -f1)  $name.tar.xz" >>"$DIR/small/pieces.sha256"
  BIG+=("$tarxz")
}

# Python's zipfile (no unzip needed), keeping the files' modes as pip would on install.
unzip_keeping_modes() {
  "$(pip_python)" -c '
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        if info.external_attr >> 16 & 0o777:
            os.chmod(path, info.external_attr >> 16 & 0o777)
' "$1" "$2"
}

# Read a tar.xz on stdin and check every file against the sha256 and size in the wheel's RECORD.
check_record() {
  "$(pip_python)" -c '
import base64, hashlib, sys, tarfile
name = sys.argv[1]
got, record = {}, None
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as tar:
    for m in tar:
        if not m.isfile():
            continue
        data = tar.extractfile(m).read()
        path = m.name.removeprefix("./")
        if path.endswith(".dist-info/RECORD"):
            record = data.decode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        got[path] = (f"sha256={digest}", str(len(data)))
if record is None:
    sys.exit(f"{name}: no .dist-info/RECORD in the re-packed tar")
bad = []
for line in record.splitlines():
    path, digest, size = line.rsplit(",", 2)
    if digest and got.get(path) != (digest, size):
        bad.append(path)
    got.pop(path, None)
if bad or got:
    sys.exit(f"{name}: re-packed files differ from its RECORD: {bad[:5]}, not in RECORD: {list(got)[:5]}")
print(f"[gpu_wheels] {name}: every file of the re-packed tar matches the wheel RECORD")
' "$1"
}

lay_out() {
  local spec whl
  rm -rf "$DIR/small" "$DIR/pieces"
  mkdir -p "$DIR/small" "$DIR/pieces"
  : >"$DIR/small/pieces.sha256"
  for spec in "${WHEELS[@]}"; do
    whl=$(wheel_file "$spec") || die "no wheel for $spec in $DIR/download (run without --no-download)"
    if [ "$(size_of "$whl")" -gt "$PIECE_BYTES" ]; then
      repack_wheel "$whl"
    else
      ln -f "$whl" "$DIR/small/" 2>/dev/null || cp "$whl" "$DIR/small/"
    fi
  done
  if [ -n "$WITH_DEBS" ]; then fetch_debs; fi
}

# What else travels in every call: tracked and untracked-not-ignored files, and shared/.
tree_bytes() {
  local files
  files=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  echo $((files + $([ -d shared ] && size_of shared || echo 0)))
}

# Cut the re-packed wheels into pieces that fill the device calls: call 1 carries $DIR/small (the
# small wheels come with the first call) and as much of the first tar.xz as fits; each later call
# one or more pieces, each piece at most --piece-size, each call at most --group-size and within
# the tool's 64 MiB together with the working tree. Then write the calls to plan.txt.
cut_and_plan() {
  local tree cap tarxz name size offset n len i
  tree=$(tree_bytes)
  cap=$((CALL_LIMIT - tree - 1024 * 1024)) # a MiB spare for the folders' own entries
  [ "$cap" -lt "$GROUP_BYTES" ] || cap=$GROUP_BYTES
  local -a room=($((cap - $(size_of "$DIR/small")))) paths=("\"$DIR/small\"")
  [ "${room[0]}" -ge 0 ] || die "$DIR/small is over a call's room of $(mib "$cap")"
  local min_piece=$((PIECE_BYTES / 16)) # no call gets a sliver when a fresh call would do
  for tarxz in "${BIG[@]}"; do
    name=$(basename "$tarxz")
    size=$(size_of "$tarxz") offset=0 n=0
    while [ "$offset" -lt "$size" ]; do
      for i in "${!room[@]}"; do
        if [ "${room[i]}" -ge "$min_piece" ] || [ "${room[i]}" -ge $((size - offset)) ]; then break; fi
        i=
      done
      if [ -z "$i" ]; then room+=("$cap") paths+=("") i=$((${#room[@]} - 1)); fi
      len=$((size - offset))
      [ "$len" -le "${room[i]}" ] || len=${room[i]}
      [ "$len" -le "$PIECE_BYTES" ] || len=$PIECE_BYTES
      local piece=$DIR/pieces/$name.part-$(printf %02d "$n")
      dd if="$tarxz" of="$piece" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$len" status=none
      room[i]=$((room[i] - len)) offset=$((offset + len)) n=$((n + 1))
      paths[i]+="${paths[i]:+, }\"$piece\""
    done
    # what the host checks: the pieces rejoin to the bytes whose sha256 pieces.sha256 holds
    grep -q "^$(cat "$DIR/pieces/$name.part-"* | sha256sum | cut -d' ' -f1)  $name\$" "$DIR/small/pieces.sha256" ||
      die "the pieces of $name do not rejoin to its recorded sha256"
    echo "[gpu_wheels] $name: $n pieces; they rejoin to the recorded sha256"
  done
  {
    echo "# scripts/gpu_wheels.sh, $(date -u +%FT%TZ): carry groups for back-to-back device calls (docs/gpu.md)."
    echo "# Each call <= $(mib "$cap"); the working tree adds $(mib "$tree") to every call (limit 64 MiB)."
    echo "# Make the calls one right after another: a machine idle for 30 s is given back with what it got."
    for i in "${!room[@]}"; do
      echo "call $((i + 1)) ($(mib $((cap - room[i])))): [${paths[i]}]"
    done
  } >"$DIR/plan.txt"
}

main() {
  parse_args "$@"
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  if [ -n "$DOWNLOAD" ]; then download_wheels; fi
  BIG=()
  lay_out
  cut_and_plan
  echo "[gpu_wheels] $DIR/small: $(ls "$DIR/small" | wc -l) files, $(mib "$(size_of "$DIR/small")")"
  ls -l "$DIR/pieces" | awk 'NR > 1 { printf "[gpu_wheels] %s/pieces/%s  %.1f MiB\n", d, $9, $5 / 1048576 }' d="$DIR"
  cat "$DIR/plan.txt"
}

main "$@"
