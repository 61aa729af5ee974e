#!/usr/bin/env bash
# The peer comparison of docs/benchmarks.md, on 4,096-token contexts of two public-domain texts: kl (as summarize reads)
# and kl-reconstruct (as compress reads) against the strongest peers at 50/20/10/5 % kept; then needle retrieval at
# 20/10 % in 2,048-token haystacks, kl's two readings and kvzip (in 4,096-token ones the default model answers 1 of 8
# planted facts even from the full cache). The peers, kl and kl-reconstruct run separately (the peers take most of
# the time and do not change when kl does; a setting used only where the document is re-read changes kl-reconstruct
# alone), each resumable (--resume: a stopped run keeps its windows; run again to go on), and are merged on the
# windows all measured. Raw results go to benchmarks/results/.
# With RERUN=BUDGETS (e.g. RERUN=50%,20%), the parts named are measured at those budgets only, into `-rerun` part files
# that supersede the same budgets of the full parts when merged: for a change that acts only at those budgets.
# With SEED=N (default 0), the fidelity windows are drawn with that seed, into files named `-sN` (seed 0 keeps the
# plain names): a fresh set of windows, none of them used to tune kl.
# Usage: benchmarks/peers.sh MOBY_DICK.txt HAMLET.md [WINDOWS] [HAYSTACKS] [PARTS: peers,kl,kl-reconstruct,needle]
# (the second text may be another play: its results are named after its file, e.g. king-lear)
# (the peers' needles run when both peers and needle are named)
set -euo pipefail
moby=$1; hamlet=$2; windows=${3:-8}; haystacks=${4:-10}; parts=,${5:-peers,kl,kl-reconstruct,needle},
here=$(dirname "$0"); out=$here/results
mkdir -p "$out/parts"
rerun=${RERUN:+-rerun}
seed=${SEED:-0}; drawn=; [[ $seed == 0 ]] || drawn=-s$seed
only() {  # BUDGETS: the budgets measured (RERUN's, if given, where it names some of them)
  if [[ -z ${RERUN:-} ]]; then echo "$1"; return; fi
  local b kept=(); for b in ${1//,/ }; do [[ ,$RERUN, == *,$b,* ]] && kept+=("$b"); done
  (IFS=,; echo "${kept[*]}")
}
merged() {  # OUTPUT PART_FILE...: each part after its rerun, if there is one (the rerun's budgets supersede)
  local output=$1 part inputs=() flags=(); shift
  for part in "$@"; do
    if [[ -f ${part%.json}-rerun.json ]]; then inputs+=("${part%.json}-rerun.json"); flags=(--supersede); fi
    inputs+=("$part")
  done
  python "$here/merge_results.py" "${inputs[@]}" -o "$output" "${flags[@]}"
}
fidelity() {  # NAME TEXT METHODS PART
  local budgets; budgets=$(only 50%,20%,10%,5%); [[ -n $budgets ]] || return 0
  klevict bench "$2" --methods "$3" --budgets "$budgets" --windows "$windows" --context 4096 --seed "$seed" \
    --quiet --resume --out "$out/parts/$4-$1-4k$drawn$rerun.json" > /dev/null
}
for text in "$moby" "$hamlet"; do
  name=$(basename "${text%.*}"); [[ $name == moby-dick ]] && name=moby  # a result's name: its text's
  [[ $parts == *,peers,* ]] && fidelity "$name" "$text" kvgrad,kvzip,expected_attention,observed_attention peers
  [[ $parts == *,kl,* ]] && fidelity "$name" "$text" kl kl
  [[ $parts == *,kl-reconstruct,* ]] && fidelity "$name" "$text" kl-reconstruct kl-reconstruct
  inputs=("$out/parts/kl-$name-4k$drawn.json" "$out/parts/kl-reconstruct-$name-4k$drawn.json"
          "$out/parts/peers-$name-4k$drawn.json")
  if [[ -f ${inputs[0]} && -f ${inputs[1]} && -f ${inputs[2]} ]]; then
    merged "$out/peers-$name-4k$drawn.json" "${inputs[@]}"
  fi
done
needle() {  # METHODS PART
  local budgets; budgets=$(only 20%,10%); [[ -n $budgets ]] || return 0
  klevict bench "$moby" --task needle --methods "$1" --budgets "$budgets" --windows "$haystacks" \
    --needles 4 --context 2048 --seed 0 --quiet --resume --out "$out/parts/needle-$2-moby-2k$rerun.json" > /dev/null
}
# the needles of kl's two readings with the part `needle`; of the peer that keeps facts best with `peers` (kvgrad
# costs 10-28x a full read)
[[ $parts == *,needle,* ]] && needle kl,kl-reconstruct kl
[[ $parts == *,peers,* && $parts == *,needle,* ]] && needle kvzip peers
if [[ -f $out/parts/needle-kl-moby-2k.json && -f $out/parts/needle-peers-moby-2k.json ]]; then
  merged "$out/needle-moby-2k.json" "$out/parts/needle-kl-moby-2k.json" "$out/parts/needle-peers-moby-2k.json"
fi
