#!/usr/bin/env bash
# Before/after on one machine: the same bench_train.py runs from two checkouts, alternating
# (before, after, before, after), so that a change is judged against run-to-run spread.
#   git worktree add /tmp/before <commit>       # or: git archive <commit> | tar -x -C DIR
#   bash bench/compare_trees.sh /tmp/before 1b qlora 8b    # ROUNDS=n: n rounds (default 2)
# Stages (each ~2-6 minutes on the H200 machine): 1b (Llama-3.2-1B full 4k, exact with and
# without masters, early_forward), qlora (Llama-3.1-8B QLoRA 4k), 8b (Llama-3.1-8B full 4k,
# exact without masters), 8b24 (Llama-3.1-8B full 4k under a 24 GiB cap with activation
# checkpointing, one optimizer per parameter stepped in backward as torchtune's
# optimizer_in_bwd does: the default, streamed), stock1b (torchtune's stock 1B full recipe and
# config with only optimizer._component_ overridden, bench_stock.py).
# Results: $OUT/<stage>-<before|after>-<round>.{json,md}.
set -uo pipefail
before=$(cd "$1" && pwd); shift
after=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/compare-trees}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
run() {  # tag, tree, bench_train args...
    local tag=$1 tree=$2; shift 2
    echo "== $tag ($tree)"
    # bench_train.py puts its own checkout first on sys.path: each tree runs its own code.
    (cd "$tree" && python3 bench/bench_train.py "$@" --out "$OUT/$tag.json" >"$OUT/$tag.md" 2>"$OUT/$tag.log") || status=1
    grep -E "^\| (offload|optimizer)" "$OUT/$tag.md" || tail -5 "$OUT/$tag.log"
}
run_stock() {  # tag, tree, bench_stock args...: each tree's recipes run its own code (PYTHONPATH)
    local tag=$1 tree=$2; shift 2
    echo "== $tag ($tree)"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 bench/bench_stock.py "$@" \
        --out "$OUT/$tag.json" >"$OUT/$tag.md" 2>"$OUT/$tag.log") || status=1
    grep -E "^\| " "$OUT/$tag.md" | tail -2 || tail -5 "$OUT/$tag.log"
}
for stage in "$@"; do
    case $stage in
    1b) args=(--model llama3_2_1b --job full --tokens-per-step 4096 --seq-len 2048 --steps 8
              --optimizers offload_grads_early,offload_grads_nomaster_early) ;;
    qlora) args=(--model llama3_1_8b --job qlora --tokens-per-step 4096 --seq-len 2048 --steps 6
                 --optimizers offload_grads) ;;
    8b) args=(--model llama3_1_8b --job full --tokens-per-step 4096 --seq-len 2048 --steps 5
              --optimizers offload_grads_nomaster_early) ;;
    8b24) args=(--model llama3_1_8b --job full --tokens-per-step 4096 --seq-len 2048 --activation-checkpointing
                --gpu-memory-gib 24 --steps 5 --warmup 2 --child-timeout 150 --optimizers offload_in_bwd) ;;
    stock1b) args=(--job full --model 1b --steps 12 --warmup 3 --runs ours_stock) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
    runner=run
    [ "$stage" = stock1b ] && runner=run_stock
    for round in $(seq "${ROUNDS:-2}"); do
        $runner "$stage-before-$round" "$before" "${args[@]}"
        $runner "$stage-after-$round" "$after" "${args[@]}"
    done
done
exit $status
