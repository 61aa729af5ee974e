#!/bin/bash
# The held-out runs again with the drift calibration refitted on recordings of one vintage (refit/record.sh, then
# power/fit.py): slope/round.sh's phases, here, with the tolerance and flat runs over twice its windows (8 a text;
# Gemma at 1,024 tokens 4; a run's first windows are a shorter run's, so the first half are the windows read
# before); then copied to benchmarks/results/drift/. bash round.sh tolerances flat drift
cd /work/main
T=benchmarks/results/tuning/drift/refit/heldout WIDE=2 exec bash benchmarks/results/tuning/slope/round.sh "$@"
