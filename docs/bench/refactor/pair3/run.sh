#!/usr/bin/env bash
O=/tmp/dpair
for i in 1 2; do
  for t in base main; do
    (cd /work/$t && .venv/bin/srl demo --out /tmp/dpair/demo_${t}_$i --json --model /work/main/runs/models/strops-s0) > $O/${t}_demo_$i.json 2> $O/${t}_demo_$i.err
    echo "$t $i rc=$? load=$(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)" >> $O/demo.log
  done
done
echo ALLDONE >> $O/demo.log
