#!/usr/bin/env bash
# Alternates srl-producer bench on the pre-refactor tree (3179eb6) and on main, 5 pairs.
O=/tmp/pair
for i in 1 2 3 4 5; do
  for t in base main; do
    (cd /work/$t && .venv/bin/srl-producer bench --json --requests 64 --max-new-tokens 128 --threads 1) > $O/${t}_engine_$i.json 2> $O/${t}_engine_$i.err
    echo "$t $i rc=$? load=$(cut -d' ' -f1 /proc/loadavg)" >> $O/engine.log
  done
done
echo ALLDONE >> $O/engine.log
