#!/usr/bin/env bash
# The GPU-machine runs behind the README's tables, in stages that each fit one 10-minute
# device call. From the repository root, with the wheels from ../shared/device/fetch-wheels.sh
# installed (see its header) and `pip install -e .` done:
#   bash bench/run_h200.sh host     # host-update rate, memory bandwidth, native kernel check, pinning methods
#   bash bench/run_h200.sh 1b       # Llama-3.2-1B full, 4k tokens/step, every optimizer
#   bash bench/run_h200.sh qlora    # Llama-3.1-8B QLoRA 4k
#   bash bench/run_h200.sh 8b4k     # Llama-3.1-8B full 4k (and 4k clipped), no master weights, and fp32 masters
#                                   # with early_forward (those need ~128 GB of host memory: the 2-GPU
#                                   # machine has it; on the one-GPU machine (125 GB) that run is skipped)
#   bash bench/run_h200.sh 8b16k    # Llama-3.1-8B full 16k (ga 4 + AC), no master weights, with the
#                                   # opt-in accumulate_on_device and delayed_update modes; each one-GPU
#                                   # stage's main table has no_update, the floor for "added GiB"
#   bash bench/run_h200.sh streamed # the streamed update (the default on a GPU): copy bandwidth and a traced
#                                   # 1B step, the step over 192 adapters, and torchtune's stock 1B full recipe
#                                   # with each optimizer and ours (about 6 minutes)
#   bash bench/run_h200.sh inbwd    # optimizer_in_bwd with the streamed update: its GPU tests, 8B full under a
#                                   # 24 GiB cap in a plain loop at 2k/4k tokens, 1B stock recipe with
#                                   # accumulation + clipping (about 7 minutes)
#   bash bench/run_h200.sh inbwd8b  # 8B full under a 24 GiB cap in our recipe and the stock one (a 16 GB
#                                   # random checkpoint is written first; about 9 minutes)
#   bash bench/run_h200.sh qlora1b  # torchtune's stock 1B QLoRA config against the drop-in, streamed and with
#                                   # the host update (OFFLOAD_PLUGIN_STREAMED=0): three alternating rounds
#                                   # (about 6 minutes)
#   bash bench/run_h200.sh qloraab  # 1B QLoRA, torch's AdamW and ours taking turns in one process, three runs
#                                   # (bench/qlora_ab.py; about 3 minutes)
#   bash bench/run_h200.sh qlora1bprofile  # a profile of each of those three (about 3 minutes)
#   bash bench/run_h200.sh lora8b   # torchtune's stock 8B QLoRA and LoRA configs against the drop-in (the
#                                   # streamed update; about 8 minutes)
#   bash bench/run_h200.sh dropin1b # torchtune's stock 1B full recipe and config with the drop-in (with and
#                                   # without optimizer_in_bwd) against our recipe and 1B config as shipped,
#                                   # three alternating rounds (about 4 minutes)
#   bash bench/run_h200.sh inbwdsweep  # the stock 1B full drop-in under optimizer_in_bwd as it ships (flushes
#                                   # of 32 M elements), with flushes of 4 M (the old default) and 128 M,
#                                   # against our recipe, two alternating rounds (about 4 minutes)
#   bash bench/run_h200.sh compactgpu  # the Triton prototype of CompactAdamW's update on the GPU (issue #20):
#                                   # its bits against the CPU update, its rate against torch's fused AdamW
#                                   # (about a minute)
#   bash bench/run_h200.sh compact8b  # issue #20: GPU tests of CompactAdamW's streamed update, then 8B
#                                   # under a 24 GiB cap at 2k and 4k tokens: it against torchao (~8 min)
#   bash bench/run_h200.sh 8bstock  # torchtune's stock 8B full config, no GPU cap: as shipped (PagedAdamW8bit),
#                                   # torchao (gradients on the GPU), the drop-in, our 8B config (about 6 minutes)
#   bash bench/run_h200.sh fsdp2    # 2 GPUs: Llama-3.1-8B full with FSDP2, 16k tokens/step (ga 2 + AC):
#                                   # GPU AdamW, FSDP2's CPUOffloadPolicy, ours (each rank its shard);
#                                   # about 4-6 minutes, at most 7 (--time-budget)
#   bash bench/run_h200.sh inbwd8b16k  # issue 42: Llama-3.1-8B full, seq 2048, activation checkpointing, stepped
#                                   # in backward, at 4k (2 x 2048) and 16k (8 x 2048) tokens per step: torch's
#                                   # fused AdamW on the GPU uncapped against ours under a 24 GiB cap (AdamW8bit,
#                                   # the default, CompactAdamW), 6 steps (2 warm-up) each, with the bytes each
#                                   # streamed step moves and the pinned copy bandwidth (bench/bus.py) beside
#                                   # them and one profiled step each for the copy window (about 6 minutes, at most 9.5)
#   bash bench/run_h200.sh inbwd16kao  # the 16k point of inbwd8b16k with torchtune's activation offloading
#                                   # (enable_activation_offloading) for ours, which at batch 8 runs out of a
#                                   # 24 GiB GPU without it even with no optimizer (about 5 minutes)
#   bash bench/run_h200.sh stock8b8bit # issue 42: torchtune's stock 8B full config, no cap: as shipped
#                                   # (PagedAdamW8bit) against the drop-in with optimizer_cls AdamW8bit, and the
#                                   # drop-in as it is (a 16 GB random checkpoint is written first; about 5 minutes)
#   bash bench/run_h200.sh hf8b     # HF's Trainer, Llama-3.1-8B full, 4k tokens, max_grad_norm 1.0: its adamw_torch_fused
#                                   # and paged_adamw_8bit uncapped against ours (AdamW8bit and exact, offloaded
#                                   # gradients) under a 24 GiB cap, the bus beside them (transformers and
#                                   # accelerate as installed there; at most 9.5 minutes, 135 s per run)
#   bash bench/run_h200.sh hf8bnoclip  # the same with max_grad_norm 0: ours updating during backward
#                                   # (OptimizerInBackward; AdamW8bit and exact) and with offloaded gradients
#   bash bench/run_h200.sh hf3b     # HF's Trainer, Llama-3.2-3B full, 4k tokens, max_grad_norm 1.0: DeepSpeed
#                                   # ZeRO-Offload (needs .whl_hf's deepspeed, pydantic, hjson; its CPU Adam compiles on
#                                   # first use), ours and adamw_torch_fused, each 24 GiB-capped but the last
#                                   # (at most 9.5 minutes)
#   bash bench/run_h200.sh fits     # issue 42: the largest torchtune model each mode fully fine-tunes under a
#                                   # 24 and a 48 GiB cap with a 64 GiB host budget (bench/what_fits.py; about
#                                   # 7 minutes, at most 9: --time-budget; the 24 GiB column comes first)
#   bash bench/run_h200.sh fits80   # the same under an 80 GiB cap (about 5 minutes, at most 9)
#   bash bench/run_h200.sh inbwd4krounds  # issue 42's 4k point (AdamW8bit, 24 GiB cap, against GPU AdamW uncapped)
#                                   # in three rounds of alternating order (about 8 minutes)
#   bash bench/run_h200.sh warps8bit   # AdamW8bit's kernel with 1-8 warps a program: bits and rate alone, then 1
#                                   # and 4 warps in an 8B backward (about 4 minutes)
#   bash bench/run_h200.sh inbwd4kitem  # inbwd4krounds with steps timed back to back to the loss's .item(), as
#                                   # torchtune's loop waits (bench_train.py --timing item; about 3 minutes)
#   bash bench/run_h200.sh inbwd4kinflight  # the 4k point (--timing item) with the bound on gradients in flight
#                                   # at 1 (as shipped), 2 and 4 GiB (OFFLOAD_PLUGIN_IN_FLIGHT_MIB), two rounds
#                                   # (about 6 minutes)
#   bash bench/run_h200.sh inbwd4khost  # inbwd4kitem, each run with its hooks' host time, the host's Python pace and
#                                   # CPU steal beside its step (about 3 minutes)
#   bash bench/run_h200.sh busprobe # the host's NUMA layout, the bus per CPU node and on newly pinned buffers, and
#                                   # four AdamW8bit 4k runs each after a bus check (about 4 minutes)
#   bash bench/run_h200.sh allocator  # AdamW8bit 4k runs with torch's caching allocator as shipped and with expandable
#                                   # segments in turns, three each, with each step's allocator retries (about 5 minutes)
#   bash bench/run_h200.sh stepprofile  # AdamW8bit 4k runs, each profiling 5 more steps one by one: what a slow step
#                                   # spends longer on, copies, kernels or neither (about 4 minutes)
#   bash bench/run_h200.sh stockqlora1  # our Gemma-2-2B and Mistral-7B QLoRA configs against the drop-in (stockqlora2:
#                                   # Qwen2.5-7B and Gemma-2-9B); random checkpoints, one run each (about 8 minutes each)
#   bash bench/run_h200.sh stock3b  # Llama-3.2-3B: our QLoRA config against the drop-in in two rounds (a 3B random
#                                   # checkpoint is written first; about 7 minutes: each run takes about 90 s)
#   bash bench/run_h200.sh stock3bfull  # Llama-3.2-3B full: the config as shipped, the drop-in and ours, 2 rounds (about 5 minutes)
# Results: bench/results/<table>/*.json (stock/, train/, fsdp2/, hf/, fits/, formats/, setup/, investigations/;
# this invocation's also copied to $OUT); logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/offload-plugin-bench}
mkdir -p "$OUT"
started=$(mktemp)  # results newer than this are this invocation's
export PYTHONUNBUFFERED=1
status=0
bench() {  # results folder (train, formats), name, args...
    local folder=$1 name=$2; shift 2
    echo "== $name: $*"
    python3 bench/bench_train.py "$@" --out "bench/results/$folder/$(date +%F)-$name.json" >"$OUT/$name.md" 2>"$OUT/$name.log" || status=1
    cat "$OUT/$name.md"
}
bench_fsdp2() {  # name, args...: like bench(), with bench_fsdp2.py (torchrun per optimizer)
    local name=$1; shift
    echo "== $name: $*"
    python3 bench/bench_fsdp2.py "$@" --out "bench/results/fsdp2/$(date +%F)-$name.json" >"$OUT/$name.md" 2>"$OUT/$name.log" || status=1
    cat "$OUT/$name.md"
}
inbwd4k() {  # name, label, args...: issue 42's 4k point (Llama-3.1-8B full, seq 2048, activation
    # checkpointing, in-backward) with AdamW8bit under a 24 GiB cap against torch's AdamW uncapped
    local name=$1 label=$2; shift 2
    bench formats "llama3_1_8b-full-4096-ac-24gib-inbwd-$name" --model llama3_1_8b --job full --tokens-per-step 4096 \
        --seq-len 2048 --activation-checkpointing --gpu-memory-gib 24 --uncapped gpu_adamw_in_bwd --steps 8 \
        --warmup 2 --child-timeout 100 --ref-numel-cap 0 --label "issue42-inbwd-$label" \
        --targets adamw8bit_in_bwd=0.9 "$@"
}
alternating() {  # round number: the two runs' order, alternating from round to round
    if [ $(($1 % 2)) = 1 ]; then echo gpu_adamw_in_bwd,adamw8bit_in_bwd; else echo adamw8bit_in_bwd,gpu_adamw_in_bwd; fi
}
for stage in "$@"; do
    case $stage in
    host)
        python3 -c "from offload_plugin.formats.adamw import native as n; k = n.kernel(); print('one-pass kernel:', 'verified' if k else n._state['reason'])"
        python3 bench/formats/host_update_rate.py --numel $((1 << 28)) 2>&1 | tee "$OUT/host_update_rate.txt"
        python3 bench/pinning.py --gib 16 --json "bench/results/setup/$(date +%F)-pinning.json" | tee "$OUT/pinning.txt" ;;
    1b)
        bench train llama3_2_1b-full-4096 --model llama3_2_1b --job full --tokens-per-step 4096 --seq-len 2048 \
            --measure-host-update --optimizers gpu_adamw,no_update,offload,offload_grads,offload_grads_early,offload_grads_delayed,offload_nomaster,offload_grads_nomaster,offload_grads_nomaster_early,torchao,bnb_paged8bit
        bench train llama3_2_1b-full-4096-clip --model llama3_2_1b --job full --tokens-per-step 4096 --seq-len 2048 \
            --clip-grad-norm 1.0 --measure-host-update --optimizers gpu_adamw,offload_grads,offload_grads_nomaster ;;
    qlora)
        bench train llama3_1_8b-qlora-4096 --model llama3_1_8b --job qlora --tokens-per-step 4096 --seq-len 2048 \
            --optimizers gpu_adamw,no_update,offload_grads,torchao ;;
    8b4k)
        bench train llama3_1_8b-full-4096 --model llama3_1_8b --job full --tokens-per-step 4096 --seq-len 2048 \
            --measure-host-update --steps 5 --optimizers gpu_adamw,no_update,offload_grads_nomaster,offload_grads_nomaster_early,offload_grads_early,torchao,bnb_paged8bit
        bench train llama3_1_8b-full-4096-clip --model llama3_1_8b --job full --tokens-per-step 4096 --seq-len 2048 \
            --clip-grad-norm 1.0 --steps 5 --optimizers gpu_adamw,offload_grads_nomaster ;;
    8b16k)
        bench train llama3_1_8b-full-16384-ga4-ac --model llama3_1_8b --job full --tokens-per-step 16384 --seq-len 2048 \
            --grad-accum 4 --activation-checkpointing --steps 6 --warmup 2 \
            --optimizers gpu_adamw,no_update,offload_grads_nomaster_devacc_delayed,bnb_paged8bit ;;
    streamed)
        python3 bench/investigations/streamed_timeline.py | tee "$OUT/streamed_timeline.json"
        python3 bench/investigations/step_overhead.py --steps 40 | tee "$OUT/step_overhead.txt"
        python3 bench/bench_stock.py --job full --model 1b --steps 10 \
            --runs stock_as_shipped,torch_adamw,torchao,ours_stock,ours_stock_no_in_bwd,ours_recipe,ours_recipe_grads_on_gpu \
            | tee "$OUT/stock_1b_full.txt" ;;
    compact8b)
        # Issue #20: CompactAdamW streamed through the GPU under optimizer_in_bwd, 8B capped
        # at 24 GiB, against torchao's offload optimizer (gradients to the host in backward).
        python3 -m pytest tests/test_compact_streamed.py tests/test_gpu_update_kernels.py -q -p no:warnings -rs 2>&1 | tail -6
        for t in 2048 4096; do
            bench train llama3_1_8b-full-$t-ac-24gib-compact-in-bwd --model llama3_1_8b --job full --tokens-per-step $t \
                --seq-len 2048 --activation-checkpointing --gpu-memory-gib 24 --steps 5 --warmup 2 \
                --child-timeout 150 --optimizers compact_in_bwd,torchao
        done ;;
    inbwd)
        python3 -m pytest tests/test_streamed_gpu.py tests/test_in_backward.py -q -p no:warnings 2>&1 | tail -3
        for t in 2048 4096; do
            bench train llama3_1_8b-full-$t-ac-24gib-in-bwd --model llama3_1_8b --job full --tokens-per-step $t \
                --seq-len 2048 --activation-checkpointing --gpu-memory-gib 24 --steps 5 --warmup 2 \
                --child-timeout 120 --optimizers offload_in_bwd,torchao
        done
        python3 bench/bench_stock.py --job full --model 1b --steps 10 \
            --runs ours_stock_accum_clip,ours_recipe_accum_clip,torchao | tee "$OUT/stock_1b_full_accum_clip.txt" ;;
    inbwd8b)
        python3 bench/bench_stock.py --job full --model 8b --gpu-gib 24 --steps 5 --warmup 2 --timeout 200 \
            --runs ours_recipe_in_bwd,ours_stock,torchao_offload_grads | tee "$OUT/stock_8b_full_24gib.txt" ;;
    qlora1b)
        python3 bench/bench_stock.py --job qlora --model 1b --runs stock_as_shipped,ours_stock,ours_stock_host_update \
            --repeats 3 --steps 16 --warmup 4 --timeout 90 | tee "$OUT/stock_1b_qlora.txt" ;;
    qloraab)
        for i in 1 2 3; do
            python3 bench/qlora_ab.py --blocks 24 --out "bench/results/stock/$(date +%F)-qlora_ab-$i.json" | tee -a "$OUT/qlora_ab.txt"
        done ;;
    qlora1bprofile)
        python3 bench/investigations/stock_profile.py --job qlora --runs stock_as_shipped,ours_stock,ours_stock_host_update \
            | tee "$OUT/stock_1b_qlora_profile.txt" ;;
    lora8b)
        python3 bench/bench_stock.py --job qlora --model 8b --runs stock_as_shipped,ours_stock --steps 8 --warmup 3 \
            --timeout 150 | tee "$OUT/stock_8b_qlora.txt"
        python3 bench/bench_stock.py --job lora --model 8b --runs stock_as_shipped,ours_stock --steps 8 --warmup 3 \
            --timeout 150 | tee "$OUT/stock_8b_lora.txt" ;;
    dropin1b)
        python3 bench/bench_stock.py --job full --model 1b --steps 12 --warmup 3 --repeats 3 \
            --runs ours_recipe,ours_stock,ours_stock_no_in_bwd | tee "$OUT/stock_1b_full_rounds.txt" ;;
    inbwdsweep)
        python3 bench/bench_stock.py --job full --model 1b --steps 12 --warmup 3 --repeats 2 \
            --runs ours_stock,ours_stock_flush_4m,ours_stock_flush_128m,ours_recipe \
            | tee "$OUT/stock_1b_full_inbwd_flush.txt" ;;
    compactgpu)
        python3 bench/formats/compact_gpu_update.py --check-numel 1049421 | tee "$OUT/compact_gpu_update.txt" ;;
    8bstock)
        python3 bench/bench_stock.py --job full --model 8b --steps 5 --warmup 2 --timeout 150 \
            --runs stock_as_shipped,torchao,ours_stock,ours_recipe | tee "$OUT/stock_8b_full.txt" ;;
    fsdp2)
        # Global 16384 tokens = 2 ranks x 2 micro-batches x 2 sequences of 2048. A child that
        # hangs or crawls is stopped at 150 s and recorded; the stage stops starting new ones
        # after 420 s.
        bench_fsdp2 fsdp2-llama3_1_8b-full-16384-ga2-ac --model llama3_1_8b --nproc 2 --tokens-per-step 16384 \
            --seq-len 2048 --grad-accum 2 --activation-checkpointing --steps 4 --warmup 1 \
            --child-timeout 150 --time-budget 420 \
            --optimizers fsdp_gpu_adamw,fsdp_cpu_offload_policy,offload_grads,offload_grads_nomaster ;;
    inbwd8b16k)
        # Ratios against torch's AdamW in the same invocation (tokens/s): --targets are issue 42's.
        # A run that could end past the stage's budget is not started (--time-budget, --child-timeout).
        python3 bench/bus.py --gib 4 --json "$OUT/bus.json" | tee "$OUT/bus.txt"
        for t in 4096 16384; do
            if [ $t = 4096 ]; then targets=adamw8bit_in_bwd=0.9,offload_in_bwd=0.8; limits=(--child-timeout 90 --time-budget 240)
            else targets=adamw8bit_in_bwd=0.97,offload_in_bwd=0.95; limits=(--child-timeout 120 --time-budget 300); fi
            bench formats llama3_1_8b-full-$t-ac-24gib-inbwd-issue42 --model llama3_1_8b --job full --tokens-per-step $t \
                --seq-len 2048 --activation-checkpointing --gpu-memory-gib 24 --uncapped gpu_adamw_in_bwd \
                --steps 6 --warmup 2 "${limits[@]}" --ref-numel-cap 0 --bus-json "$OUT/bus.json" --profile-bus \
                --label issue42-inbwd --targets $targets \
                --optimizers gpu_adamw_in_bwd,adamw8bit_in_bwd,offload_in_bwd,compact_in_bwd
        done
        python3 bench/report.py --results bench/results/formats --only "$(date +%F)-llama3_1_8b-full-*-issue42.json" | tee "$OUT/issue42_inbwd.md" ;;
    inbwd16kao)
        python3 bench/bus.py --gib 4 --json "$OUT/bus.json" | tee "$OUT/bus.txt"
        bench formats llama3_1_8b-full-16384-ac-ao-24gib-inbwd-issue42 --model llama3_1_8b --job full --tokens-per-step 16384 \
            --seq-len 2048 --activation-checkpointing --activation-offloading --gpu-memory-gib 24 \
            --uncapped gpu_adamw_in_bwd --steps 5 --warmup 2 --child-timeout 150 --time-budget 400 --ref-numel-cap 0 \
            --bus-json "$OUT/bus.json" --label issue42-inbwd-16k-ao --targets adamw8bit_in_bwd=0.97,offload_in_bwd=0.95 \
            --optimizers gpu_adamw_in_bwd,adamw8bit_in_bwd,offload_in_bwd ;;
    stock8b8bit)
        python3 bench/bench_stock.py --job full --model 8b --steps 5 --warmup 2 --timeout 150 \
            --runs stock_as_shipped,ours_stock_adamw8bit,ours_stock \
            --out "bench/results/formats/$(date +%F)-stock-8b-full-adamw8bit.json" | tee "$OUT/stock_8b_full_adamw8bit.txt" ;;
    hf8b)
        # HF's Trainer as its users run it (HF's default clipping), the bus measured in the same call
        python3 bench/bus.py --gib 4 --json "$OUT/bus.json" | tee "$OUT/bus.txt"
        python3 bench/bench_hf.py --model llama3_1_8b --tokens-per-step 4096 --max-grad-norm 1.0 --steps 4 \
            --warmup 2 --timeout 135 --runs adamw_torch_fused,paged_adamw_8bit,ours_8bit_grads:24,ours_grads:24 \
            --out "bench/results/hf/$(date +%F)-hf-trainer-llama3_1_8b-4096-clip1.json" | tee "$OUT/hf_8b.txt" ;;
    hf3b)
        # DeepSpeed ZeRO-Offload keeps 16 B per parameter in host memory (fp32 master, moments,
        # gradients): 8B would need 128 GB, more than this host has; 3B needs 51
        python3 bench/bus.py --gib 4 --json "$OUT/bus.json" | tee "$OUT/bus.txt"
        python3 bench/bench_hf.py --model llama3_2_3b --tokens-per-step 4096 --max-grad-norm 1.0 --steps 4 \
            --warmup 2 --timeout 170 --runs deepspeed_offload:24,ours_8bit_grads:24,ours_grads:24,adamw_torch_fused \
            --out "bench/results/hf/$(date +%F)-hf-trainer-llama3_2_3b-4096-clip1.json" | tee "$OUT/hf_3b.txt" ;;
    hf8bnoclip)
        python3 bench/bus.py --gib 4 --json "$OUT/bus.json" | tee "$OUT/bus.txt"
        python3 bench/bench_hf.py --model llama3_1_8b --tokens-per-step 4096 --max-grad-norm 0 --steps 4 \
            --warmup 2 --timeout 135 --runs adamw_torch_fused,ours_8bit_inbwd:24,ours_inbwd:24,ours_8bit_grads:24 \
            --out "bench/results/hf/$(date +%F)-hf-trainer-llama3_1_8b-4096-noclip.json" | tee "$OUT/hf_8b_noclip.txt" ;;
    fits)
        python3 bench/what_fits.py --caps 24,48 --time-budget 540 \
            --out "bench/results/fits/$(date +%F)-fits-24-48.json" 2>"$OUT/fits_24_48.log" | tee "$OUT/fits_24_48.md" ;;
    fits80)
        python3 bench/what_fits.py --caps 80 --time-budget 540 \
            --out "bench/results/fits/$(date +%F)-fits-80.json" 2>"$OUT/fits_80.log" | tee "$OUT/fits_80.md" ;;
    inbwd4krounds)
        # issue 42's 4k point, AdamW8bit under a 24 GiB cap against torch's AdamW uncapped, in three
        # rounds whose order alternates: single runs of one setting vary by up to 0.2 s a step
        for i in 1 2 3; do
            inbwd4k round$i rounds --optimizers "$(alternating $i)"
        done ;;
    warps8bit)
        # AdamW8bit's kernel launched with 1, 2, 4 and 8 warps a program (adamw8bit_gpu.WARPS): each checked
        # for the host update's bits and timed alone, then 1 and 4 inside an 8B backward under a 24 GiB cap,
        # in ABBA order (about 4 minutes)
        python3 bench/formats/adamw8bit_gpu_update.py --warps 1,2,4,8 \
            --json "bench/results/formats/$(date +%F)-adamw8bit-kernel-warps.json" | tee "$OUT/kernel_warps.txt"
        python3 bench/investigations/inbwd_timeline.py --layers 32 --cap-gib 24 --steps 3 \
            --runs none,gpu_adamw,adamw8bit@4,adamw8bit@1,adamw8bit@1,adamw8bit@4 --profile adamw8bit@4,adamw8bit@1 \
            --json "bench/results/investigations/$(date +%F)-inbwd-timeline-warps.json" 2>"$OUT/timeline_warps.log" \
            | tee "$OUT/timeline_warps.txt" ;;
    inbwd4kitem)
        # inbwd4krounds timed as a recipe runs: each step ends at the loss's .item() (the compute stream),
        # the next begins there; the streamed update's last copies out overlap the next forward
        for i in 1 2 3; do
            inbwd4k item-round$i item --timing item --optimizers "$(alternating $i)"
        done ;;
    inbwd4kinflight)
        # the hooks wait 0.16-0.20 s a step on the 1 GiB bound at 4k: does a larger one buy time under the cap?
        for i in 1 2; do
            for mib in 1024 2048 4096; do
                OFFLOAD_PLUGIN_IN_FLIGHT_MIB=$mib inbwd4k inflight$mib-round$i inflight$mib --timing item \
                    --optimizers "$(alternating $i)"
            done
        done ;;
    inbwd4khost)
        # inbwd4kitem again, each run with its hooks' host seconds a step, a fixed Python loop's time and the
        # machine's CPU steal (bench_train.py records them for in-backward runs): is a slow run a slow host?
        for i in 1 2 3; do
            inbwd4k host-round$i host --timing item --optimizers "$(alternating $i)"
        done ;;
    busprobe)
        # why single AdamW8bit runs at 4k take 0.61-0.63 s or 0.68-0.75 s a step, each run one or the other
        # throughout: the host's NUMA layout, the bus on newly pinned buffers per CPU node and over time, and
        # AdamW8bit-only runs each after a bus check
        nvidia-smi topo -m 2>&1 | head -12
        lscpu 2>&1 | grep -E "^(CPU\(s\)|Model name|Socket|NUMA)"
        for node in /sys/devices/system/node/node[0-9]*; do
            echo "== bound to $(basename "$node") (CPUs $(cat "$node/cpulist"))"
            taskset -c "$(cat "$node/cpulist")" python3 bench/bus.py --gib 2 --series 6
        done
        echo "== unbound"
        python3 bench/bus.py --gib 2 --series 6
        for i in 1 2 3 4; do
            python3 bench/bus.py --gib 2 --series 2
            inbwd4k busprobe-run$i busprobe --timing item --optimizers adamw8bit_in_bwd
        done ;;
    allocator)
        # AdamW8bit at 4k with the caching allocator as shipped and with expandable segments
        # (PYTORCH_CUDA_ALLOC_CONF), three runs each in turns, each step's allocator retries,
        # cudaMalloc and cudaFree calls in its JSON; GPU AdamW once
        for i in 1 2 3; do
            for conf in $([ $((i % 2)) = 1 ] && echo "default expandable" || echo "expandable default"); do
                PYTORCH_CUDA_ALLOC_CONF=$([ $conf = expandable ] && echo expandable_segments:True) \
                    inbwd4k alloc$conf-round$i alloc$conf --timing item --optimizers adamw8bit_in_bwd
            done
        done
        inbwd4k alloc-reference reference --timing item --optimizers gpu_adamw_in_bwd ;;
    stepprofile)
        # AdamW8bit at 4k, three runs, each then profiling 5 more steps one at a time (their wall
        # time, copy time each way, kernel time: step_profiles in the JSON); GPU AdamW once
        for i in 1 2 3; do
            inbwd4k profile-round$i profile --timing item --optimizers adamw8bit_in_bwd --profile-steps 5 --child-timeout 200
        done
        inbwd4k profile-reference reference --timing item --optimizers gpu_adamw_in_bwd --profile-steps 3 --child-timeout 200 ;;
    stockqlora1|stockqlora2)
        # Our QLoRA configs for Gemma 2, Mistral and Qwen2.5 against the drop-in (each model's
        # random checkpoint is removed after its runs: the disk holds about three)
        models=$([ "$stage" = stockqlora1 ] && echo "gemma2_2b mistral_7b" || echo "qwen2_5_7b gemma2_9b")
        for model in $models; do
            python3 bench/bench_stock.py --job qlora --model "$model" --runs ours_stock,ours_recipe --steps 10 \
                --warmup 3 --timeout 150 --out "bench/results/stock/$(date +%F)-stock-$model-qlora-ours-vs-dropin.json" \
                | tee "$OUT/stock_${model}_qlora.txt"
            rm -rf "/tmp/offload-plugin/stock/random-$model"
        done ;;
    stock3b)
        python3 bench/bench_stock.py --job qlora --model 3b --runs ours_stock,ours_recipe --repeats 2 --steps 12 \
            --warmup 3 --timeout 100 --out "bench/results/stock/$(date +%F)-stock-3b-qlora-rounds.json" \
            | tee "$OUT/stock_3b_qlora_rounds.txt" ;;
    stock3bfull)
        python3 bench/bench_stock.py --job full --model 3b --runs stock_as_shipped,ours_stock,ours_recipe --repeats 2 \
            --steps 12 --warmup 3 --timeout 120 --out "bench/results/stock/$(date +%F)-stock-3b-full.json" | tee "$OUT/stock_3b_full.txt" ;;
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
find bench/results -name '*.json' -newer "$started" -exec cp {} "$OUT/" \;
exit $status
