#!/usr/bin/env bash
# Fidelity against context length: kl (as summarize reads) and kl-reconstruct (as compress reads) against the strongest
# peers, on windows of 256 to 7,936 tokens of two public-domain texts, at 50/20/10/5 % kept and at 32 and 64 entries
# per head. Every read goes inside the chat frame, as the CLI reads a document. The default model has 8,192 positions,
# so its longest window is 7,936 tokens plus the 256 teacher-forced ones. Fewer windows for the long contexts.
# Each part (peers, kl, kl-reconstruct) of each length and text is its own resumable run (--resume), merged into
# benchmarks/results/lengths-TEXT-LENGTH.json once all three exist.
# Usage: [WINDOWS=N] benchmarks/lengths.sh MOBY_DICK.txt HAMLET.md [LENGTHS, default 256,512,1024,4096,7936] [PARTS]
set -euo pipefail
moby=$1; hamlet=$2; lengths=${3:-256,512,1024,4096,7936}; parts=,${4:-peers,kl,kl-reconstruct},
here=$(dirname "$0"); out=$here/results
mkdir -p "$out/parts"
budgets=50%,20%,10%,5%,32,64
peers=kvgrad,kvzip,expected_attention,observed_attention,snapkv,streaming
windows() {  # LENGTH -> windows per text (WINDOWS=N: N at every length)
  if [[ -n ${WINDOWS:-} ]]; then echo "$WINDOWS"; elif (( $1 <= 1024 )); then echo 8; elif (( $1 <= 4096 )); then echo 4
  else echo 2; fi
}
for length in ${lengths//,/ }; do
  for pair in "moby:$moby" "hamlet:$hamlet"; do
    name=${pair%%:*}; text=${pair#*:}
    for part in peers kl kl-reconstruct; do
      [[ $parts == *,$part,* ]] || continue
      methods=$part; [[ $part == peers ]] && methods=$peers
      klevict bench "$text" --methods "$methods" --budgets "$budgets" --windows "$(windows "$length")" \
        --context "$length" --seed 1 --quiet --resume --out "$out/parts/lengths-$part-$name-$length.json" > /dev/null
    done
    inputs=("$out/parts/lengths-kl-$name-$length.json" "$out/parts/lengths-kl-reconstruct-$name-$length.json"
            "$out/parts/lengths-peers-$name-$length.json")
    if [[ -f ${inputs[0]} && -f ${inputs[1]} && -f ${inputs[2]} ]]; then
      python "$here/merge_results.py" "${inputs[@]}" -o "$out/lengths-$name-$length.json"
    fi
  done
done
