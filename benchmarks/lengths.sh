#!/usr/bin/env bash
# Fidelity against context length: kl (as summarize reads) and kl-reconstruct (as compress reads) against the strongest
# peers, on windows of 256 to 7,936 tokens of two public-domain texts, at 50/20/10/5 % kept and at 32 and 64 entries
# per head. Every read goes inside the chat frame, as the CLI reads a document. The default model has 8,192 positions,
# so its longest window is 7,936 tokens plus the 256 teacher-forced ones. Fewer windows for the long contexts.
# Each part (peers, kl, kl-reconstruct) of each length and text is its own resumable run (--resume), merged into
# benchmarks/results/lengths-TEXT-LENGTH.json once all three exist.
# PARTS (comma-separated): peers, kl, kl-reconstruct, or the peers split as peers-cheap, peers-kvzip, peers-kvgrad
# (the long windows: each part then fits a session and resumes on its own).
# MODEL=gemma3-270m reads with that model (files named ...-LENGTH-gemma3-270m.json): its 32,768 positions reach the
# sweep's 16,384-token windows, which the default model's 8,192 do not.
# Usage: [WINDOWS=N] [MODEL=M] benchmarks/lengths.sh MOBY_DICK.txt HAMLET.md [LENGTHS, default 256,512,1024,4096,7936]
#        [PARTS]
set -euo pipefail
moby=$1; hamlet=$2; lengths=${3:-256,512,1024,4096,7936}; parts=,${4:-peers,kl,kl-reconstruct},
here=$(dirname "$0"); out=$here/results
mkdir -p "$out/parts"
budgets=50%,20%,10%,5%,32,64
declare -A part_methods=([peers]=kvgrad,kvzip,expected_attention,observed_attention,snapkv,streaming [kl]=kl
  [kl-reconstruct]=kl-reconstruct [peers-cheap]=expected_attention,observed_attention,snapkv,streaming
  [peers-kvzip]=kvzip [peers-kvgrad]=kvgrad)
model=(); suffix=""
if [[ -n ${MODEL:-} ]]; then model=(--model "$MODEL"); suffix=-$MODEL; fi
windows() {  # LENGTH -> windows per text (WINDOWS=N: N at every length)
  if [[ -n ${WINDOWS:-} ]]; then echo "$WINDOWS"; elif (( $1 <= 1024 )); then echo 8; elif (( $1 <= 4096 )); then echo 4
  else echo 2; fi
}
for length in ${lengths//,/ }; do
  for pair in "moby:$moby" "hamlet:$hamlet"; do
    name=${pair%%:*}; text=${pair#*:}
    inputs=()
    for part in kl kl-reconstruct peers peers-cheap peers-kvzip peers-kvgrad; do
      file=$out/parts/lengths-$part-$name-$length$suffix.json
      if [[ $parts == *,$part,* ]]; then
        klevict bench "$text" "${model[@]}" --methods "${part_methods[$part]}" --budgets "$budgets" \
          --windows "$(windows "$length")" --context "$length" --seed 1 --quiet --resume --out "$file" > /dev/null
      fi
      [[ -f $file ]] && inputs+=("$file")
    done
    if (( ${#inputs[@]} >= 3 )); then  # kl, kl-reconstruct and at least one part of the peers
      python "$here/merge_results.py" "${inputs[@]}" -o "$out/lengths-$name-$length$suffix.json"
    fi
  done
done
