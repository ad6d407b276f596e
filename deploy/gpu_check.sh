#!/usr/bin/env bash
# srl's GPU paths on a lent CUDA machine, in about 4-6 minutes, every step time-bounded
# (worst case about 7 minutes: run it under a 450 s limit).
#
# What it runs (results in $OUT, flat names, at most 8 files):
#   0. installs the wheels of .whl/ into $SITE (the packages the machine's image lacks) and
#      prints nvidia-smi, python, torch/CUDA and transformers versions;
#   1. `srl demo` (the real one: embedded broker, dispatcher, two hf generator pools, trainer)
#      with both generator pools and the trainer on $DEVICE                -> gpu_report.json/.png
#   2. on $DEVICE, then on cpu: `srl-producer bench` (hf engine tokens/s, batch 1, batch 32,
#      batch 32 publishing) and trainer optimizer steps (app.bench.train's timed steps,
#      plain-torch backend, 64 synthetic rows a step, the demo's model)      -> bench.txt
#   3. time allowing, the same demo with everything on cpu, the same machine -> cpu_report.json
#   plus log.txt (everything printed), roles_log.txt (the role logs' tails), nvsmi.csv
#   (GPU utilisation and memory sampled every second during the GPU demo).
#
# How the demo's roles get the device: `srl demo` has no device option (its plan writes
# device = "cpu" for the trainer; the generator's default is cpu) and it strips SRL_* from the
# roles' environment. The roles are the console scripts srl-producer / srl-consumer found on
# PATH; this script writes those (python -c wrappers, the repo on PYTHONPATH) and the wrappers
# append `--device $DEVICE` to `srl-producer generate` and `srl-consumer train`: a CLI option
# wins over the config file (srl/config.py), so the roles run on the GPU with no code change.
# The demo's own before/after held-out evaluation (app.warmstart.evaluate) stays on cpu.
#
# Usage on the device machine (repo root; carry .whl and runs/models/strops-s0):
#   bash deploy/gpu_check.sh
# Local rehearsal without a GPU (no install, cpu only, 2 steps; the venv's base interpreter
# with its site-packages on PYTHONPATH, so that no srl-* script lies beside the interpreter,
# as on the device machine, and the roles start through this script's wrappers):
#   PY=$(readlink -f .venv/bin/python) EXTRA_PYTHONPATH=$PWD/.venv/lib/python3.11/site-packages \
#   INSTALL=0 SKIP_CUDA=1 STEPS=2 EVAL_PROMPTS=16 BENCH_REQUESTS=8 BENCH_TOKENS=16 \
#   TRAIN_ROWS=16 OUT=/tmp/gpucheck nice -n 10 bash deploy/gpu_check.sh
# Knobs (environment): OUT (required), PY (python3), INSTALL (1), SITE (/tmp/site),
# SKIP_CUDA (0), DEVICE (cuda), STEPS (20), EVAL_PROMPTS (64), EXTRA_PYTHONPATH (prepended),
# BENCH_REQUESTS (32), BENCH_TOKENS (64), TRAIN_ROWS (64),
# BUDGET_S (330: the benchmarks and step 3 start only within it),
# CPU_DEMO (1: step 3 when at least CPU_DEMO_MIN_S seconds of BUDGET_S remain).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

PY=${PY:-python3}
case $PY in # absolute: the roles run with the demo's out folder as their cwd
    */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;;
    *) PY=$(command -v "$PY") ;;
esac
INSTALL=${INSTALL:-1}
SITE=${SITE:-/tmp/site}
SKIP_CUDA=${SKIP_CUDA:-0}
DEVICE=${DEVICE:-cuda}
[ "$SKIP_CUDA" = 1 ] && DEVICE=cpu
STEPS=${STEPS:-20}
EVAL_PROMPTS=${EVAL_PROMPTS:-64}
CPU_DEMO=${CPU_DEMO:-1}
BENCH_REQUESTS=${BENCH_REQUESTS:-32}
BENCH_TOKENS=${BENCH_TOKENS:-64}
TRAIN_ROWS=${TRAIN_ROWS:-64}
BUDGET_S=${BUDGET_S:-330}
CPU_DEMO_MIN_S=${CPU_DEMO_MIN_S:-120}
MODEL=$ROOT/runs/models/strops-s0
WORK=$(mktemp -d /tmp/srl-gpucheck.XXXXXX)
T0=$SECONDS

# processes whose command line names $WORK: the check's brokers and roles (by pid, only ours)
leftovers() {
    local p cmd found=1
    for p in /proc/[0-9]*; do
        cmd=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
        if [[ $cmd == *"$WORK"* ]]; then echo "${p#/proc/} ${cmd:0:160}"; found=0; fi
    done
    return $found
}
cleanup() {
    local pids
    pids=$(leftovers | cut -d' ' -f1) || return 0
    echo "stopping leftover processes of this check: $pids"
    kill $pids 2>/dev/null || true
    sleep 3
    kill -9 $pids 2>/dev/null || true
}
room() {
    [ "$(left)" -ge "$1" ] && return 0
    echo "!!! skipped: under $1 s of the ${BUDGET_S} s budget left"
    return 1
}
say() { printf '\n=== [%4ds] %s\n' "$((SECONDS - T0))" "$*"; }
left() { echo $((BUDGET_S - (SECONDS - T0))); }
# run a step under a time limit; a failing step is reported, the next step still runs
step() {
    local limit=$1 rc=0
    shift
    timeout --kill-after=15 "$limit" "$@" || rc=$?
    [ "$rc" = 0 ] || echo "!!! exit $rc (124/137: over ${limit}s): $*"
    return 0
}

main() {
trap cleanup EXIT
# -- 0. environment ----------------------------------------------------------------------
say "install wheels, versions"
if [ "$INSTALL" = 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl
    PYTHONPATH=$SITE:$ROOT
else
    PYTHONPATH=$ROOT
fi
[ -n "${EXTRA_PYTHONPATH:-}" ] && PYTHONPATH=$EXTRA_PYTHONPATH:$PYTHONPATH
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK/tmp"
export TMPDIR=$WORK/tmp # the bench's broker data lives here: leftovers() finds it

# the console scripts the demo starts (app.demoplan.console_script looks on PATH)
mkdir -p "$WORK/bin"
wrapper() { # name module inject-device-for-subcommand
    cat >"$WORK/bin/$1" <<EOF
#!/usr/bin/env bash
args=("\$@")
if [ "\${1:-}" = "$3" ] && [ -n "$4" ]; then args+=(--device "$4"); fi
echo "[gpu_check wrapper] $1 \${args[*]}" >&2
exec "$PY" -c 'import sys; sys.argv[0] = "$1"; from $2 import main; main()' "\${args[@]}"
EOF
    chmod +x "$WORK/bin/$1"
}
wrapper srl app.cli.main - ""
wrapper srl-producer app.cli.producer generate "$DEVICE"
wrapper srl-consumer app.cli.consumer train "$DEVICE"
export PATH=$WORK/bin:$PATH

uname -a
[ "$SKIP_CUDA" = 1 ] || step 30 nvidia-smi
step 90 "$PY" - <<'EOF'
import sys, torch, transformers, pydantic, confluent_kafka, fastavro, orjson
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
print("transformers", transformers.__version__, transformers.__file__)
print("pydantic", pydantic.VERSION, "confluent_kafka", confluent_kafka.version(),
      "fastavro", fastavro.__version__, "orjson", orjson.__version__)
from srl.broker import broker_binary
print("broker", broker_binary())
from producers.engines.hf import HFEngine  # noqa: F401  (imports transformers' cache utils)
import app.demo  # noqa: F401
print("srl imports ok")
EOF
if srl --help >/dev/null; then echo "srl CLI ok (wrappers in $WORK/bin)"; else echo "!!! srl"; fi

if [ ! -f "$MODEL/config.json" ]; then
    say "no $MODEL (not carried): srl init-model builds it on cpu (minutes)"
    step 300 srl init-model
fi

# -- 1. the demo on $DEVICE ----------------------------------------------------------------
demo() { # device out-dir time-limit
    step "$3" srl demo --steps "$STEPS" --eval-prompts "$EVAL_PROMPTS" --eval-every 0 \
        --model "$MODEL" --out "$2" --timeout-s "$(($3 - 40))"
    # each role log starts with the wrapper's line: the command line, --device included
    # (app.demoplan.console_script prefers scripts beside sys.executable: none on that machine)
    for f in trainer gen-regular gen-longtail; do
        grep -q "gpu_check wrapper.*--device $1" "$2/logs/$f.log" 2>/dev/null ||
            echo "!!! $f did not start through this script's wrapper: its device is not $1"
    done
    for f in "$2"/logs/*.log; do
        [ -f "$f" ] || continue
        echo "----- $(basename "$f") ($1): first line (the command), last 25 lines"
        head -n 1 "$f"
        tail -n 25 "$f"
    done >>"$OUT/roles_log.txt"
}

say "1. srl demo, generators + trainer on $DEVICE, --steps $STEPS"
NVSMI_PID=""
if [ "$SKIP_CUDA" != 1 ]; then
    timeout 400 nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw \
        --format=csv -l 1 >"$OUT/nvsmi.csv" 2>&1 &
    NVSMI_PID=$!
fi
demo "$DEVICE" "$WORK/demo-$DEVICE" 210
[ -n "$NVSMI_PID" ] && kill "$NVSMI_PID" 2>/dev/null || true
cp "$WORK/demo-$DEVICE/report.json" "$OUT/gpu_report.json" 2>/dev/null || echo "!!! no report.json"
cp "$WORK/demo-$DEVICE/report.png" "$OUT/gpu_report.png" 2>/dev/null || echo "!!! no report.png"
"$PY" - "$OUT/gpu_report.json" <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("status", "steps", "wall_s", "total_wall_s", "tokens_per_s", "tokens_generated",
        "eval_accuracy_before", "eval_accuracy_after", "reward_first", "reward_last")
print({k: r.get(k) for k in keys})
EOF
leftovers && cleanup || echo "no process of this check left running"

# -- 2. engine and trainer-step benchmarks -------------------------------------------------
say "2. hf engine tokens/s and trainer steps: $DEVICE vs cpu"
devices=("$DEVICE")
[ "$DEVICE" = cpu ] || devices+=(cpu)
for dev in "${devices[@]}"; do
    room 60 || break
    echo "### srl-producer bench --engine hf --device $dev" >>"$OUT/bench.txt"
    step 60 srl-producer -v bench --engine hf --model "$MODEL" --device "$dev" --max-batch 32 \
        --requests "$BENCH_REQUESTS" --max-new-tokens "$BENCH_TOKENS" --repeats 2 --seed 0 --json \
        >>"$OUT/bench.txt" 2>"$WORK/bench-$dev.err"
    tail -n 15 "$WORK/bench-$dev.err"
    room 30 || break
    # app.bench.train's timed steps (make_micro_batch -> Engine.backward -> Engine.step, one
    # warm-up step; float(loss) and the clip's norm sync the GPU each step) on the demo's model
    # and TRAIN_ROWS rows a step (64: the demo's 8 groups x 8 samples; that bench's rows:
    # 32 prompt tokens, completions log-normal around 128), on $dev, not its fixed cpu
    step 60 "$PY" - "$dev" "$MODEL" "$TRAIN_ROWS" >>"$OUT/bench.txt" <<'EOF'
import json, sys
import numpy as np, torch
from app.bench.train import time_steps
from consumers.config import TrainConfig
from consumers.engine import Engine
dev, model, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
eng = Engine(TrainConfig.model_validate({"model": model, "device": dev, "lr": 1e-5}))
times, tokens, padded = time_steps(eng, np.random.default_rng(0), 5, rows, 4096)
print(json.dumps({"trainer_step": dev, "threads": torch.get_num_threads(), "rows_per_step": rows,
                  "completion_tokens": tokens, "padded_tokens": padded,
                  "tokens_per_s": round(tokens / sum(times), 1),
                  "step_s_median": round(float(np.median(times)), 4)}))
EOF
done
cat "$OUT/bench.txt" 2>/dev/null || true

# -- 3. the same demo on cpu, time allowing ------------------------------------------------
if [ "$DEVICE" != cpu ] && [ "$CPU_DEMO" = 1 ] && [ "$(left)" -ge "$CPU_DEMO_MIN_S" ]; then
    limit=$(left)
    say "3. srl demo, everything on cpu (baseline on this machine), limit ${limit}s"
    wrapper srl-producer app.cli.producer generate cpu
    wrapper srl-consumer app.cli.consumer train cpu
    demo cpu "$WORK/demo-cpu" "$limit"
    cp "$WORK/demo-cpu/report.json" "$OUT/cpu_report.json" 2>/dev/null || echo "!!! no report.json"
else
    say "3. cpu demo skipped ($(left)s of ${BUDGET_S}s left; CPU_DEMO=$CPU_DEMO, DEVICE=$DEVICE)"
fi

say "done in $((SECONDS - T0))s; files in $OUT:"
ls -la "$OUT"
}

main 2>&1 | tee -a "$OUT/log.txt"
