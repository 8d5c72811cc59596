#!/usr/bin/env bash
# The GPU checks in one command, for the lent GPU host (offline; docs/gpu.md says how a session
# gets the tree and the wheels there). What needs no fbgemm-gpu comes first, so that a run cut
# short, or one whose fbgemm-gpu pieces did not all arrive, still brings back figures:
#   setup           pip-install the carried small wheels, unpack redis-server
#   setup-fbgemm    rejoin the carried pieces of fbgemm-gpu and unpack them (seconds; may fail alone)
#   versions        python, torch, CUDA, the GPU, triton, fbgemm_gpu, torchrec
#   build           the CPU kernels the CUDA tests compare with
#   tests-plain     the CUDA tests that need neither TorchRec nor fbgemm-gpu (-m "cuda and not torchrec")
#   bench-idtransformer   bench/idtransformer_bench.py --device cuda (MCH beside it where torchrec imports)
#   profile-idtransformer bench/idtransformer_profile.py: the triton pass's device and wall time a
#                   batch, 1 table and 26, and its costliest operators (the trace into $OUT)
#   tests-torchrec  the CUDA tests that need them (-m "cuda and torchrec")
#   bench-train     bench/train_bench.py --device cuda --dlrm-sizes --batch-size 8192, then at 512 a step
# Each step runs under its own time cap and the whole run under GPU_CHECK_BUDGET; a step that
# would start with less time left than it needs is skipped with a row saying so. After every
# step $OUT holds results.json and table.txt as they stand (a run killed from outside leaves the
# steps done, and names the one it was in); gpu_check.log holds every step's output. The table
# is printed at the end (also on SIGTERM/SIGINT).
#
#   scripts/gpu_check.sh                  # every step
#   scripts/gpu_check.sh --only tests     # setup, versions and build, then the CUDA tests
#   scripts/gpu_check.sh --only bench     # setup, versions and build, then the GPU benchmarks
#   scripts/gpu_check.sh --dry-run        # the steps, their caps and commands, doing nothing
#
# Without a GPU (e.g. here) it runs as far as it can and reports the GPU steps "no GPU: skipped".
# Environment: PYTHON (default python3: on the host the one with torch), OUT (default
# bench/out/gpu_check), GPU_CHECK_BUDGET (seconds for the whole run, default 480: a device call
# runs at most 600, and a session's 15 device minutes hold the machine's start and the carry
# calls), GPU_WHEELS (default .whl), GPU_SITE (default /tmp/site), GPU_CHECK_IDT_ARGS and
# GPU_CHECK_TRAIN_ARGS (more arguments for the two benchmarks).
# Exit status: 1 if a step failed (the other steps still run), 2 for bad arguments, else 0.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PY=${PYTHON:-python3}
WHL=${GPU_WHEELS:-.whl}
SITE=${GPU_SITE:-/tmp/site}
RESULTS=${OUT:-$ROOT/bench/out/gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-480}
LOG=$RESULTS/gpu_check.log
DRY=
ONLY=

# The steps in order; the most seconds each may take (the budget left caps it too), and the
# fewest it must have left to start (about what it took on an H200, docs/gpu.md).
STEPS=(setup setup-fbgemm versions build tests-plain bench-idtransformer profile-idtransformer tests-torchrec
  bench-train)
declare -A MAX_S=([setup]=90 [setup-fbgemm]=120 [versions]=60 [build]=180 [tests-plain]=180
  [bench-idtransformer]=150 [profile-idtransformer]=120 [tests-torchrec]=240 [bench-train]=180)
declare -A MIN_S=([setup]=10 [setup-fbgemm]=20 [versions]=20 [build]=20 [tests-plain]=30
  [bench-idtransformer]=20 [profile-idtransformer]=45 [tests-torchrec]=60 [bench-train]=80)
declare -A PART=([tests-plain]=tests [tests-torchrec]=tests [bench-idtransformer]=bench [profile-idtransformer]=bench
  [bench-train]=bench)

# What the steps found out, for the later ones (the versions step sets them).
HAVE_GPU=
HAVE_FBGEMM=
HAVE_TORCHREC=
NO_FBGEMM="not installed"   # why fbgemm_gpu is not there: "not installed" or "does not import (...)"
NO_TORCHREC="not installed"

# One row per step for the table and results.json; the step under way.
ROW_NAME=() ROW_STATUS=() ROW_FIGURE=() ROW_SECS=()
STEP_SKIP= STEP_FIGURE= STEP_BUDGET=0 FAILED=0 RUNNING= RUNNING_SINCE=0 CHILD= STARTED=0 FINISHED=

die() { echo "gpu_check: $*" >&2; exit 2; }

parse_args() {
  while [ $# -gt 0 ]; do
    case $1 in
      --dry-run) DRY=1 ;;
      --only)
        ONLY=${2:-}
        case $ONLY in tests | bench) ;; *) die "--only takes 'tests' or 'bench', not '${ONLY}'" ;; esac
        shift
        ;;
      -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
  done
  [[ $BUDGET =~ ^[0-9]+$ ]] || die "GPU_CHECK_BUDGET must be whole seconds, not '$BUDGET'"
}

# Run a command under the step's time cap (timeout kills its whole process group: torchrun's
# ranks too); under --dry-run only print it. Waited for in the background, so that a signal to
# this script is handled at once (on_signal), not when the command ends; without fd 3 (the
# script's stdout), so that a command left running by a kill does not hold the caller's pipe.
sh_() {
  if [ -n "$DRY" ]; then
    echo "    would run: $(quoted "$@")"
    return 0
  fi
  echo "+ $(quoted "$@")"
  timeout -k 10 "$STEP_BUDGET" "$@" <&0 3>&- &
  CHILD=$!
  local rc=0
  wait "$CHILD" || rc=$?
  CHILD=
  return "$rc"
}

skip() { STEP_SKIP=$1; }

# The words of a command as a shell would read them back, quoting only where needed.
quoted() {
  local w out=()
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./=:,+@%*-]+$ ]]; then
      out+=("$w")
    elif [[ $w != *"'"* ]]; then
      out+=("'$w'")
    else
      out+=("$(printf %q "$w")")
    fi
  done
  echo "${out[*]}"
}

# --- the steps: each sets STEP_FIGURE (or calls skip) and returns non-zero on failure ---------

# The small wheels into $SITE/small (pip, offline), redis-server's .debs unpacked beside them:
# all that the steps before fbgemm-gpu need, from the first device call.
step_setup() {
  local dir=$SITE/small stamp want wheels
  if [ -n "$DRY" ]; then
    sh_ "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" "$WHL/small/*.whl"
    echo "    dpkg-deb -x $WHL/small/*.deb (redis-server for the tests' fixtures); PYTHONPATH=$ROOT:$SITE/small:$SITE/pieces"
    return 0
  fi
  if [ ! -d "$WHL/small" ]; then
    skip "no $WHL/small: nothing to install (scripts/gpu_wheels.sh, then carry it)"
    return 0
  fi
  stamp=$dir/.gpu_check.stamp
  want=$(sha256sum "$WHL/small/"* | sha256sum | cut -c1-16)
  wheels=("$WHL/small/"*.whl)
  [ -e "${wheels[0]}" ] || wheels=()
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    STEP_FIGURE="already installed in $dir"
  else
    rm -rf "$dir" && mkdir -p "$dir" || return 1
    [ ${#wheels[@]} = 0 ] || PIP_ROOT_USER_ACTION=ignore sh_ "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" "${wheels[@]}" || return 1
    echo "$want" >"$stamp"
    STEP_FIGURE="${#wheels[@]} small wheels"
  fi
  setup_redis "$dir/.redis"
}

# Each large wheel (fbgemm-gpu) from its pieces: join them, check the sha256 taken when they were
# cut, unpack into $SITE/pieces. No pieces here: a skip row, and the steps that need fbgemm-gpu
# say so; pieces that do not rejoin: a failure naming them. Either way the run goes on.
step_setup_fbgemm() {
  local sums=$WHL/small/pieces.sha256 dir=$SITE/pieces stamp want sum name parts joined=0 absent=()
  if [ -n "$DRY" ]; then
    echo "    join $WHL/pieces/<wheel>.tar.xz.part-NN, check each against $sums, unpack into $dir"
    return 0
  fi
  if [ ! -e "$sums" ]; then
    skip "nothing to unpack: no $sums (scripts/gpu_wheels.sh, then carry $WHL/small)"
    return 0
  fi
  stamp=$dir/.gpu_check.stamp
  # an install made before all the pieces came is redone
  want=$( (cat "$sums"; ls -l "$WHL/pieces" 2>/dev/null) | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    STEP_FIGURE="already installed in $dir"
    return 0
  fi
  rm -rf "$dir" && mkdir -p "$dir" || return 1
  while read -r sum name; do
    [ -n "$sum" ] && [ "${sum:0:1}" != "#" ] || continue
    parts=("$WHL/pieces/$name.part-"*)
    if [ ! -e "${parts[0]}" ]; then
      echo "$name: no pieces here, so ${name%%-*} is absent (carry the calls of $WHL/plan.txt in order)"
      absent+=("${name%%-*}")
      continue
    fi
    echo "$name: joining ${#parts[@]} pieces"
    cat "${parts[@]}" >"$dir/$name"
    if [ "$(sha256sum "$dir/$name" | cut -d' ' -f1)" != "$sum" ]; then
      echo "$name: the ${#parts[@]} pieces here (${parts[*]##*/}) do not give sha256 $sum: one is missing or damaged"
      rm -f "$dir/$name"
      STEP_FIGURE="$name: pieces missing or damaged"
      return 1
    fi
    unpack_tar_xz "$dir/$name" "$dir" || return 1
    rm -f "$dir/$name"
    joined=$((joined + 1))
  done <"$sums"
  [ ${#absent[@]} -gt 0 ] || echo "$want" >"$stamp"  # with pieces absent, a second run looks again
  if [ "$joined" = 0 ] && [ ${#absent[@]} -gt 0 ]; then
    skip "no pieces here for ${absent[*]} (carry the calls of $WHL/plan.txt)"
    return 0
  fi
  STEP_FIGURE="$joined re-joined from pieces${absent[*]:+; absent, no pieces: ${absent[*]}}"
}

# xz's own threads where the host has xz, else Python's tarfile (standard library).
unpack_tar_xz() {
  if command -v xz >/dev/null; then
    xz -dc -T0 "$1" | tar -x -C "$2"
  else
    "$PY" -m tarfile -e "$1" "$2"
  fi
}

# Debian's redis-server (redis-check-rdb under another name: it picks its role from argv[0]),
# as scripts/setup_env.sh lays it out, for tests whose fixtures start one.
setup_redis() {
  local dir=$1 tool
  [ -e "$WHL/small/redis-tools.deb" ] || { echo "no redis-tools.deb carried: tests that start Redis fail"; return 0; }
  if [ ! -x "$dir/bin/redis-server" ]; then
    for deb in "$WHL/small/"*.deb; do dpkg-deb -x "$deb" "$dir"; done
    ln -sf redis-check-rdb "$dir/usr/bin/redis-server"
    mkdir -p "$dir/bin"
    for tool in redis-server redis-cli; do
      printf '#!/usr/bin/env bash\nexport LD_LIBRARY_PATH="%s/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\nexec "%s/usr/bin/%s" "$@"\n' \
        "$dir" "$dir" "$tool" >"$dir/bin/$tool"
      chmod +x "$dir/bin/$tool"
    done
  fi
  export DYNEMB_REDIS_SERVER=$dir/bin/redis-server
  "$DYNEMB_REDIS_SERVER" --version || echo "the carried redis-server does not run here: tests that start Redis fail"
}

# Versions of what the checks rely on; fails when a module the project needs does not import.
step_versions() {
  local facts=$WORK/versions.sh
  local rc=0
  sh_ "$PY" - "$facts" <<'PY' || rc=$?
import importlib, importlib.metadata as md, platform, shlex, sys

def version(module, dist=None):
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module.split(".")[0]:
            return None, "not installed"
        return None, f"does not import ({type(exc).__name__}: {str(exc)[:100]})"
    except Exception as exc:  # an import that crashes is as absent as a missing one
        return None, f"does not import ({type(exc).__name__}: {str(exc)[:100]})"
    try:
        return md.version(dist or module), None
    except md.PackageNotFoundError:
        return getattr(sys.modules[module], "__version__", "?"), None

print(f"python {platform.python_version()} ({sys.executable})")
facts, figure, missing = {}, [], []
try:
    import torch
    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {gpu}")
    figure.append(f"torch {torch.__version__}")
    if gpu:
        p = torch.cuda.get_device_properties(0)
        print(f"GPU 0: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
              f"{p.multi_processor_count} SMs, {torch.cuda.device_count()} device(s)")
        figure += [f"CUDA {torch.version.cuda}", p.name]
    else:
        figure.append("no GPU")
    facts["HAVE_GPU"] = "1" if gpu else ""
except Exception as exc:
    print(f"torch does not import: {exc}")
    missing.append("torch")
    facts["HAVE_GPU"] = ""
# the project's own needs (pyproject.toml), then the GPU side's (absent: their steps skip)
needed = {"numpy": None, "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
          "grpc_reflection": "grpcio-reflection", "google.protobuf": "protobuf", "redis": None,
          "hiredis": None, "xxhash": None, "prometheus_client": "prometheus-client", "tqdm": None,
          "safetensors": None, "h5py": None, "google_crc32c": "google-crc32c", "yaml": "pyyaml",
          "ninja": None, "pytest": None, "hypothesis": None}
optional = {"triton": None, "fbgemm_gpu": "fbgemm-gpu", "torchrec": None, "tensordict": None,
            "torchmetrics": None, "cupy": "cupy-cuda13x"}
found = {}
for group, mods in (("needed", needed), ("optional", optional)):
    for module, dist in mods.items():
        v, why = found[module] = version(module, dist)
        print(f"  {group:8} {module:18} {v or 'ABSENT: ' + why}")
        if v is None and group == "needed":
            missing.append(module)
        if module in ("triton", "fbgemm_gpu", "torchrec"):
            figure.append(f"{module} {v or 'absent'}")
for module, key in (("fbgemm_gpu", "FBGEMM"), ("torchrec", "TORCHREC")):
    v, why = found[module]
    facts[f"HAVE_{key}"] = "1" if v else ""
    facts[f"NO_{key}"] = why or ""
if missing:
    figure.insert(0, f"MISSING {' '.join(missing)}")
facts["STEP_FIGURE"] = ", ".join(figure)
with open(sys.argv[1], "w") as f:
    f.writelines(f"{k}={shlex.quote(v)}\n" for k, v in facts.items())
sys.exit(1 if missing else 0)
PY
  if [ -z "$DRY" ] && [ -e "$facts" ]; then source "$facts"; fi
  return "$rc"
}

step_build() {
  if [ -z "$DRY" ] && [ -z "$HAVE_GPU" ]; then skip "no GPU: skipped"; return 0; fi
  # the CUDA tests hold the GPU paths to the compiled CPU kernel; both are cached by source hash
  sh_ "$PY" -c "from dynemb.idtransformer.kernel import ops; ops()" || { STEP_FIGURE="ID transformer kernel"; return 1; }
  sh_ "$PY" -c "from dynemb.ps_server.native import id_index; id_index()" || { STEP_FIGURE="PS id index"; return 1; }
  STEP_FIGURE="ID transformer kernel, PS id index"
}

# Why a step that needs fbgemm-gpu and torchrec cannot run ("" when it can).
no_torchrec() {
  if [ -z "$HAVE_FBGEMM" ]; then
    echo "fbgemm-gpu $NO_FBGEMM: skipped"
  elif [ -z "$HAVE_TORCHREC" ]; then
    echo "torchrec $NO_TORCHREC: skipped"
  fi
}

step_tests_plain() {
  if [ -z "$DRY" ] && [ -z "$HAVE_GPU" ]; then skip "no GPU: skipped"; return 0; fi
  cuda_tests plain "cuda and not torchrec"
}

step_tests_torchrec() {
  if [ -z "$DRY" ]; then
    local why
    why=$(no_torchrec)
    if [ -n "$why" ]; then skip "$why"; return 0; fi
    if [ -z "$HAVE_GPU" ]; then skip "no GPU: skipped"; return 0; fi
  fi
  cuda_tests torchrec "cuda and torchrec"
}

# pytest -m EXPR over the suite, its counts as the figure. The `torchrec` marker: tests/conftest.py.
cuda_tests() {
  local junit=$RESULTS/junit-$1.xml rc=0
  # A module that cannot be imported here must not hide the others' CUDA tests; it still fails the step.
  sh_ "$PY" -m pytest -m "$2" -q --continue-on-collection-errors --junitxml "$junit" tests || rc=$?
  [ -z "$DRY" ] || return 0
  if [ "$rc" = 5 ]; then skip "no test is marked $2"; return 0; fi
  STEP_FIGURE=$("$PY" -c '
import sys, xml.etree.ElementTree as ET
t = f = e = s = 0
for suite in ET.parse(sys.argv[1]).getroot().iter("testsuite"):
    t += int(suite.get("tests", 0)); f += int(suite.get("failures", 0))
    e += int(suite.get("errors", 0)); s += int(suite.get("skipped", 0))
print(f"{t - f - e - s} passed, {f} failed, {e} errors, {s} skipped")
' "$junit" 2>/dev/null || echo "no junit report (pytest exit $rc)")
  return "$rc"
}

step_bench_idtransformer() {
  if [ -z "$DRY" ] && [ -z "$HAVE_GPU" ]; then skip "no GPU: skipped"; return 0; fi
  local args=(--device cuda) note= out=$WORK/bench-idtransformer.out rc=0 why
  if [ -z "$DRY" ]; then
    why=$(no_torchrec)
    if [ -n "$why" ]; then
      args+=(--skip-mch)
      note="; MCH not run: ${why%: skipped}"
      echo "${why%: skipped}: timing ours alone (--skip-mch), no ratio"
    fi
  fi
  # shellcheck disable=SC2086  # extra arguments are meant to split
  sh_ "$PY" bench/idtransformer_bench.py "${args[@]}" ${GPU_CHECK_IDT_ARGS:-} >"$out" 2>&1 || rc=$?
  cat "$out"
  [ -z "$DRY" ] || return 0
  STEP_FIGURE="$(figure_from "$out" 'idtransformer (triton)' 'ratio IDs/s')$note"
  return "$rc"
}

step_profile_idtransformer() {
  if [ -z "$DRY" ] && [ -z "$HAVE_GPU" ]; then skip "no GPU: skipped"; return 0; fi
  local out=$WORK/profile-idtransformer.out rc=0
  sh_ "$PY" bench/idtransformer_profile.py --trace "$RESULTS/profile-trace.json" >"$out" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    sh_ "$PY" bench/idtransformer_profile.py --tables 26 --batch 65536 --warmup 8 --batches 3 >>"$out" 2>&1 || rc=$?
  fi
  cat "$out"
  [ -z "$DRY" ] || return 0
  # "busy of wall ms a batch", for 1 table, then 26
  STEP_FIGURE=$(tr '\r' '\n' <"$out" | awk '
    /wall per batch/ { wall = $5 }
    /device busy per batch/ { printf "%s%s of %s ms", sep, $5, wall; sep = "; " }')
  STEP_FIGURE="device busy of wall a batch, 1 and 26 tables: ${STEP_FIGURE:-?}"
  return "$rc"
}

step_bench_train() {
  if [ -z "$DRY" ]; then
    local why
    why=$(no_torchrec)
    if [ -n "$why" ]; then skip "$why"; return 0; fi
    if [ -z "$HAVE_GPU" ]; then skip "no GPU: skipped"; return 0; fi
  fi
  local out=$WORK/bench-train.out small=$WORK/bench-train-512.out rc=0
  # a DLRM's sizes (issue 43's figure), then the old 512-sample step: what launches cost
  # shellcheck disable=SC2086
  sh_ "$PY" bench/train_bench.py --device cuda ${GPU_CHECK_TRAIN_ARGS:---dlrm-sizes --batch-size 8192} >"$out" 2>&1 ||
    rc=$?
  cat "$out"
  sh_ "$PY" bench/train_bench.py --device cuda --steps 100 >"$small" 2>&1 || true
  cat "$small"
  [ -z "$DRY" ] || return 0
  STEP_FIGURE="$(figure_from "$out" 'dynamic tables' 'ratio dynamic / full'); 512 a step: $(figure_from "$small" 'dynamic tables' 'ratio dynamic / full')"
  return "$rc"
}

# "<first pattern's figures>; <second's>" from a benchmark's output: the numbers on its last
# line matching each pattern, e.g. "ours 89,778,428 IDs/s 0.5120; ratio 0.23".
figure_from() {
  local out=$1 a b
  # (tqdm's bars share a line with the result through carriage returns: split them off)
  a=$(tr '\r' '\n' <"$out" | grep -F -- "$2" | grep -vF '%|' | tail -1 | grep -oE '[0-9][0-9,]*(\.[0-9]+)?' |
    head -2 | paste -sd' ' || true)
  b=$(tr '\r' '\n' <"$out" | grep -F -- "$3" | grep -vF '%|' | tail -1 | grep -oE '[0-9][0-9,]*\.[0-9]+' | head -1 || true)
  echo "${2}: ${a:-?}${b:+; ${3}: $b}"
}

# --- the runner ----------------------------------------------------------------------------

# Run one step: its output into the log, its row into the table and results.json.
run_step() {
  local name=$1 fn=step_${1//-/_} start rc=0 status remaining offset
  start=$(date +%s)
  STEP_SKIP= STEP_FIGURE=
  remaining=$((DEADLINE - start))
  STEP_BUDGET=$((MAX_S[$name] < remaining ? MAX_S[$name] : remaining))
  if [ -n "$ONLY" ] && [ -n "${PART[$name]:-}" ] && [ "${PART[$name]}" != "$ONLY" ]; then
    add_row "$name" skipped "not asked (--only $ONLY)" 0
    return 0
  fi
  if [ -n "$DRY" ]; then
    echo "step $name (at most ${MAX_S[$name]} s; starts only with ${MIN_S[$name]} s of the budget left):"
    "$fn"
    add_row "$name" skipped "dry run" 0
    return 0
  fi
  if [ "$remaining" -lt "${MIN_S[$name]}" ]; then
    add_row "$name" skipped "out of time: $((remaining > 0 ? remaining : 0)) s left of GPU_CHECK_BUDGET=$BUDGET, needs ${MIN_S[$name]}" 0
    echo "[gpu_check] $name: skipped, out of time"
    return 0
  fi
  echo "[gpu_check] $name: start (at most $STEP_BUDGET s)"
  RUNNING=$name RUNNING_SINCE=$start
  write_results
  offset=$(stat -c %s "$LOG")
  printf '\n===== %s (at most %s s) %s =====\n' "$name" "$STEP_BUDGET" "$(date -u +%FT%TZ)" >>"$LOG"
  # In this shell, not a pipeline or subshell: a step sets variables for the later ones. Called
  # after ||, the step runs without set -e, so each step checks its own commands.
  "$fn" >>"$LOG" 2>&1 </dev/null || rc=$?
  RUNNING=
  if [ -n "$STEP_SKIP" ]; then
    status=skipped STEP_FIGURE=$STEP_SKIP
  elif [ "$rc" = 0 ]; then
    status=pass
  else
    status=fail FAILED=1
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then STEP_FIGURE="timed out after $STEP_BUDGET s; ${STEP_FIGURE}"; fi
    echo "[gpu_check] $name failed (exit $rc); the end of its log:"
    tail -c +"$((offset + 1))" "$LOG" | tail -n 15 | sed 's/^/    /'
  fi
  add_row "$name" "$status" "${STEP_FIGURE:-}" $(($(date +%s) - start))
  echo "[gpu_check] $name: $status, $(($(date +%s) - start)) s: ${STEP_FIGURE:-}"
}

add_row() {
  ROW_NAME+=("$1") ROW_STATUS+=("$2") ROW_FIGURE+=("$3") ROW_SECS+=("$4")
  [ -n "$DRY" ] || write_results
}

# results.json and table.txt as they stand: after every step and when one starts, so that a call
# cut short still brings back the steps done and names the one it was in.
write_results() {
  local i
  # each written aside, then renamed: a run killed while writing leaves the last whole one
  print_table >"$RESULTS/table.txt.new" && mv -f "$RESULTS/table.txt.new" "$RESULTS/table.txt" \
    || echo "[gpu_check] could not write table.txt" >&2
  for i in "${!ROW_NAME[@]}"; do
    printf '%s\t%s\t%s\t%s\n' "${ROW_NAME[i]}" "${ROW_STATUS[i]}" "${ROW_FIGURE[i]}" "${ROW_SECS[i]}"
  done | "$PY" -c '
import json, sys, time
steps = [dict(zip(("step", "status", "figure", "seconds"), line.rstrip("\n").split("\t")))
         for line in sys.stdin if line.strip()]
for s in steps:
    s["seconds"] = int(s["seconds"])
out, running, since, budget, started, finished = sys.argv[1:7]
json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": int(budget),
           "elapsed_s": int(time.time()) - int(started), "finished": finished == "1",
           "running": {"step": running, "seconds": int(time.time()) - int(since)} if running else None,
           "steps": steps, "failed": any(s["status"] == "fail" for s in steps)}, open(out, "w"), indent=1)
' "$RESULTS/results.json.new" "$RUNNING" "$RUNNING_SINCE" "$BUDGET" "$STARTED" "${FINISHED:-}" \
    && mv -f "$RESULTS/results.json.new" "$RESULTS/results.json" || echo "[gpu_check] could not write results.json" >&2
}

print_table() {
  local i
  echo
  printf '%-21s %-8s %7s  %s\n' step status seconds "key figure"
  printf '%-21s %-8s %7s  %s\n' --------------------- -------- ------- ----------
  for i in "${!ROW_NAME[@]}"; do
    printf '%-21s %-8s %7s  %s\n' "${ROW_NAME[i]}" "${ROW_STATUS[i]}" "${ROW_SECS[i]}" "${ROW_FIGURE[i]}"
  done
  if [ -n "$RUNNING" ]; then
    printf '%-21s %-8s %7s  %s\n' "$RUNNING" running $(($(date +%s) - RUNNING_SINCE)) "(at most $STEP_BUDGET s)"
  fi
  if [ -z "$DRY" ]; then echo "(logs: $LOG; $RESULTS/results.json)"; fi
}

# Killed from outside (the device tool's timeout, ^C): the step under way gets a failed row, and
# the table is written and printed as at the end.
on_signal() {
  trap - TERM INT HUP
  if [ -n "$CHILD" ]; then  # timeout passes it on to the command's process group
    kill -TERM "$CHILD" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$CHILD" 2>/dev/null && sleep 0.5 || break; done
    kill -KILL "$CHILD" 2>/dev/null || true
  fi
  if [ -n "$RUNNING" ]; then
    local name=$RUNNING
    RUNNING=
    FAILED=1
    add_row "$name" fail "killed (SIG$1) after $(($(date +%s) - RUNNING_SINCE)) s" $(($(date +%s) - RUNNING_SINCE))
  fi
  finish >&3  # the script's own stdout: the step's output may go to the log here
  exit $((128 + $(kill -l "$1")))
}

finish() {
  FINISHED=1
  [ -n "$DRY" ] || write_results
  print_table
}

main() {
  parse_args "$@"
  STARTED=$(date +%s)
  DEADLINE=$((STARTED + BUDGET))
  export PYTHONPATH="$ROOT:$SITE/small:$SITE/pieces${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  exec 3>&1
  if [ -n "$DRY" ]; then
    echo "gpu_check --dry-run: python $PY, wheels from $WHL into $SITE, results into $RESULTS, budget $BUDGET s"
  else
    mkdir -p "$RESULTS"
    rm -f "$RESULTS/results.json" "$RESULTS/table.txt" "$RESULTS/"junit-*.xml
    : >"$LOG"
    echo "[gpu_check] $(date -u +%FT%TZ) python $PY, results into $RESULTS, budget $BUDGET s"
    local sig
    # shellcheck disable=SC2064  # the signal's name is meant to be fixed now
    for sig in TERM INT HUP; do trap "on_signal $sig" "$sig"; done
  fi
  local name
  for name in "${STEPS[@]}"; do run_step "$name"; done
  finish
  return "$FAILED"
}

main "$@"
