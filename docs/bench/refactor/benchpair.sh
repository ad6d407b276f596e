#!/usr/bin/env bash
# Runs each benchmark on the pre-refactor tree (/work/base, 3179eb6) and on main, alternately.
set -u
B=/work/base/.venv/bin; N=/work/main/.venv/bin; O=/tmp/bench
run() { # label dir cmd...
  local label=$1; shift; local dir=$1; shift
  local t0=$(date +%s); (cd $dir && "$@") > $O/$label.json 2> $O/$label.err; echo "$label rc=$? $(( $(date +%s)-t0 ))s load=$(cut -d' ' -f1 /proc/loadavg)" >> $O/log.txt
}
for i in 1 2; do
  run base_dataplane_$i /work/base $B/srl bench dataplane --json
  run new_dataplane_$i /work/main $N/srl bench dataplane --json
done
run base_engine /work/base $B/srl-producer bench --json
run new_engine /work/main $N/srl-producer bench --json
run base_train /work/base $B/python -m consumers.bench
run new_train /work/main $N/python -m app.bench.train
run base_weights /work/base $B/srl bench weights --json
run new_weights /work/main $N/srl bench weights --json
run base_pipeline /work/base $B/srl bench pipeline --json
run new_pipeline /work/main $N/srl bench pipeline --json
run base_demo /work/base $B/srl demo --out /tmp/bench/demo_base --json --model /work/main/runs/models/strops-s0
run new_demo /work/main $N/srl demo --out /tmp/bench/demo_new --json --model /work/main/runs/models/strops-s0
echo ALLDONE >> $O/log.txt
