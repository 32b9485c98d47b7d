#!/usr/bin/env bash
# The GPU check (issue #15), on a machine with CUDA, from the source tree, on that machine's
# own PyTorch. First every torch name paratrain uses is looked up (paratrain.comm.compat's
# `missing()`: a release without one stops here, naming it). Then four parts, each with a
# header line and a time limit:
#   (a) equivalence: every layout against plain PyTorch on the same GPU, float32
#       (scripts/gpu_check.py: world 1 with each data-parallel wrapper; NCCL layouts with
#       two or more GPUs; dp x pp x tp with eight); the report names the layouts skipped
#       for lack of GPUs
#   (a') the same layouts at world 2 on the CPU over gloo, on this machine's torch: a
#       one-GPU machine still trains every strategy with collectives (skipped by --cpu,
#       whose (a) is this already)
#   (b) the default `paratrain train` on CUDA (bf16), 50 steps, one rank per GPU (up to 8)
#   (c) one GPU's throughput on a GPT of about 1B parameters in bf16: tokens/s, MFU, and
#       model-state bytes (ours, the planner's, max_memory_allocated)
# then a compact report to paste into docs/benchmarks.md. Exit status 1 if any part failed.
#
#   bash scripts/gpu-check.sh                 on the GPU machine (at most 5 minutes, one GPU)
#   bash scripts/gpu-check.sh --cpu           a rehearsal of the same steps on a CPU, tiny
#   bash scripts/gpu-check.sh --make-wheels   here, before the tree travels to the GPU
#   PYTHON=/path/to/python bash scripts/gpu-check.sh    another interpreter (default python3)
#
# Dependencies: torch is the machine's; paratrain runs from src/ (PYTHONPATH=src:., the root
# for tests/). Of paratrain's other dependencies these parts import only tomli_w (config)
# and tqdm (progress), both pure Python, and numpy (data/tokens.py, data/checks.py;
# checked by importing every module the parts use with nothing but torch on the path);
# matplotlib draws loss.png if present (the run says when it is not); safetensors (export)
# is not needed. Missing ones are installed from
# scripts/wheels/ into a temporary folder put on PYTHONPATH (`pip install --no-index
# --find-links scripts/wheels --no-deps --target`, or the wheels themselves on the path
# where there is no pip: numpy then cannot be had). The wheels are made here, on the
# development machine, by `--make-wheels`: `pip download` of py3-none-any wheels, which
# any Python 3 takes, and numpy's manylinux2014 binary wheel for the GPU machine's Python
# (GPU_PYTHON_VERSION, default 3.12); scripts/wheels/ is git-ignored, so the device run
# must carry it.
#
# The report (for docs/benchmarks.md) is printed at the end and kept, with every part's log,
# in the folder named on the first line (OUT/report.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
WHEELS=scripts/wheels

if [[ ${1:-} == --make-wheels ]]; then
    mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps --only-binary=:all: --dest "$WHEELS" tomli-w tqdm || exit 2
    exec "$PY" -m pip download --no-deps --only-binary=:all: --dest "$WHEELS" \
        --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 numpy
fi
DEVICE=cuda
[[ ${1:-} == --cpu ]] && DEVICE=cpu

export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=$(mktemp -d "${TMPDIR:-/tmp}/paratrain-gpu-check.XXXXXX")
echo "gpu-check: logs and runs in $OUT"

# --- torch and its devices -------------------------------------------------------------
if ! INFO=$("$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())"); then
    echo "gpu-check: $PY cannot import torch" >&2
    exit 2
fi
read -r TORCH_VERSION HAS_CUDA NGPU <<<"$INFO"
echo "torch $TORCH_VERSION, cuda available: $HAS_CUDA, devices: $NGPU"
if [[ $DEVICE == cuda && ($HAS_CUDA != True || $NGPU -lt 1) ]]; then
    echo "gpu-check: no CUDA device; for a rehearsal on the CPU: bash scripts/gpu-check.sh --cpu" >&2
    exit 2
fi

# --- dependencies: the missing ones from scripts/wheels/ ---------------------------------
missing() {  # the distributions, of those named as MODULE=DIST, whose module is not found
    "$PY" -c '
import importlib.util, sys
for pair in sys.argv[1:]:
    module, dist = pair.split("=")
    if importlib.util.find_spec(module) is None:
        print(dist)' "$@"
}
DEPS="$OUT/deps"
HAVE_PIP=$("$PY" -m pip --version >/dev/null 2>&1 && echo yes)
install() {  # install DIST...: from the wheels into DEPS; without pip, pure-Python ones only
    if [[ $HAVE_PIP == yes ]]; then
        "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps \
            --target "$DEPS" "$@"
        return
    fi
    for wheel in "$WHEELS"/*-none-any.whl; do  # a zip archive Python imports from as it is
        [[ -e $wheel ]] && PYTHONPATH="$PYTHONPATH:$PWD/$wheel"
    done
}
export PYTHONPATH="$PYTHONPATH:$DEPS"
NEEDED=(tomli_w=tomli-w tqdm=tqdm numpy=numpy)
MISSING=$(missing "${NEEDED[@]}")
if [[ -n $MISSING ]]; then
    echo "missing:" $MISSING "- installing from $WHEELS/"
    # shellcheck disable=SC2086  # one word per distribution
    install $MISSING
    MISSING=$(missing "${NEEDED[@]}")
    if [[ -n $MISSING ]]; then
        echo "gpu-check: still missing" $MISSING "- run 'bash scripts/gpu-check.sh --make-wheels' where PyPI is reachable and carry $WHEELS/" >&2
        exit 2
    fi
fi
# --- every torch name paratrain uses, before anything runs ------------------------------
if ! "$PY" -W ignore -c '
import sys
from paratrain.comm import compat
problems = compat.missing()
print(*problems, sep="\n", file=sys.stderr)
sys.exit(1 if problems else 0)'; then
    echo "gpu-check: torch $TORCH_VERSION lacks the names above (src/paratrain/comm/compat.py)" >&2
    exit 2
fi
echo "torch names: every one of paratrain.comm.compat resolves on torch $TORCH_VERSION"

# --- the parts -----------------------------------------------------------------------------
declare -A STATUS
part() {  # part NAME LIMIT_S COMMAND...: a header, the output kept in OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo
    echo "=== $name (limit ${limit} s): $* ==="
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    STATUS[$name]=${PIPESTATUS[0]}
    echo "=== $name: exit ${STATUS[$name]} after $((SECONDS - start)) s ==="
}

if [[ $DEVICE == cuda ]]; then
    NPROC=1
    for n in 2 4 8; do ((NGPU >= n)) && NPROC=$n; done
    MICRO=$((NPROC > 2 ? 16 / NPROC : 8))  # the default global batch 16 over NPROC replicas
    EQ_LIMIT=$((NGPU >= 2 ? 240 : 60))  # one GPU: 60 + 80 + 60 + 100 s at most: 5 minutes
    STEPS=50
    THROUGHPUT=()
else
    NPROC=2 MICRO=8 EQ_LIMIT=120 STEPS=5
    THROUGHPUT=(--tiny)
fi
# float32 in full: no TF32 in cuBLAS, whatever this PyTorch build or image defaults to.
NVIDIA_TF32_OVERRIDE=0 part equivalence "$EQ_LIMIT" "$PY" scripts/gpu_check.py equivalence \
    --device "$DEVICE"
if [[ $DEVICE == cuda ]]; then  # 2 ranks over gloo: what a single GPU cannot train
    part equivalence-cpu 80 "$PY" scripts/gpu_check.py equivalence --device cpu --world 2
else
    STATUS[equivalence-cpu]=skipped
fi
TRAIN=(train --device "$DEVICE" --nproc "$NPROC" --micro-batch "$MICRO" --steps "$STEPS")
part train 60 "$PY" -m paratrain "${TRAIN[@]}" --out "$OUT/train-run" --json
part throughput 100 "$PY" -m paratrain.bench.gpu.throughput --device "$DEVICE" ${THROUGHPUT[@]+"${THROUGHPUT[@]}"}

# --- the report --------------------------------------------------------------------------
echo
echo "=================== report (for docs/benchmarks.md) ==================="
"$PY" - "$OUT" "$DEVICE" "paratrain ${TRAIN[*]}" <<'EOF' | tee "$OUT/report.md"
import datetime, json, platform, subprocess, sys
from pathlib import Path

import torch

out, device, train_command = Path(sys.argv[1]), *sys.argv[2:]
def log(name):
    path = out / f"{name}.log"
    return path.read_text().splitlines() if path.exists() else []
def last_json(lines):
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None

commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
if device == "cuda":
    n = torch.cuda.device_count()
    gpu = f"{torch.cuda.get_device_name(0)} x{n}, CUDA {torch.version.cuda}"
else:
    gpu = "CPU rehearsal (no GPU)"
print(f"### GPU check, {datetime.date.today()}: {gpu}")
print(f"torch {torch.__version__}, Python {platform.python_version()}, "
      f"commit {commit.stdout.strip() or 'unknown'}")
print("\n(a) equivalence")
EQ_LINES = ("|", "tolerances", "equivalence", "skipped")
print("\n".join(line for line in log("equivalence") if line.startswith(EQ_LINES)) or "no output")
if device == "cuda":
    print("\n(a') equivalence on the CPU, 2 ranks over gloo, this torch")
    print("\n".join(line for line in log("equivalence-cpu") if line.startswith(EQ_LINES)) or "no output")
print(f"\n(b) `{train_command}` (defaults otherwise)")
train = log("train")
summary = last_json(train)
if summary is None and train:
    print("no summary; the log ends:", *train[-3:], sep="\n  ")
elif summary is None:
    pass
else:
    print(next((line for line in train if line.startswith("trained ")), ""))
    measured = summary.get("model_state_bytes_per_rank")
    predicted = [r["total"] for r in summary.get("predicted", {}).get("model_state_bytes", [])]
    print(f"model state per rank, measured {measured} / predicted {predicted} bytes; "
          f"max_memory_allocated per rank {summary.get('cuda_max_allocated_bytes')}")
print("\n(c) throughput")
print("\n".join(line for line in log("throughput") if not line.startswith("{")) or "no output")
EOF
echo
FAILED=0
for name in equivalence equivalence-cpu train throughput; do
    case ${STATUS[$name]} in
    0) echo "$name: ok" ;;
    skipped) echo "$name: skipped" ;;
    *) echo "$name: FAILED (exit ${STATUS[$name]})" && FAILED=1 ;;
    esac
done
echo "report: $OUT/report.md; logs: $OUT"
exit $FAILED
