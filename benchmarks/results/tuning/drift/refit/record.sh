#!/bin/bash
# Seed-0 tuning recordings with the code as it is (bfloat16 probes, the drift from the logits' change) where the
# calibration's fit still used recordings of earlier code (../lanes/: float32 probes, two windows a text): SmolLM2 at
# 512 tokens (4 windows a text) and 1,024 (3), Gemma-3-270M at 512 (4). Two runs at a time, one thread each.
# bash benchmarks/results/tuning/drift/refit/record.sh; then python benchmarks/results/tuning/drift/power/fit.py
cd /work/main
source benchmarks/results/tuning/drift/power/record.sh  # rec NAME TEXT MODEL WINDOWS CONTEXT, into $OUT
OUT=benchmarks/results/tuning/drift/refit
rec lanes4-smol-moby-512 $M smollm2-135m 4 512 & rec lanes4-smol-hamlet-512 $H smollm2-135m 4 512 & wait
rec lanes4-smol-moby-1024 $M smollm2-135m 3 1024 & rec lanes4-smol-hamlet-1024 $H smollm2-135m 3 1024 & wait
rec lanes4-gemma-moby-512 $M gemma3-270m 4 512 & rec lanes4-gemma-hamlet-512 $H gemma3-270m 4 512 & wait
