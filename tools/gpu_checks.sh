#!/usr/bin/env bash
# The GPU checks of issue 30 in one device call, most important first, under one deadline:
#
#   bash tools/gpu_checks.sh SECONDS        # on the device machine; results in $OUT
#
# 1. the CUDA tests (tests/test_cuda_steps.py, the CUDA cases of tests/test_mixed_precision.py and
#    tests/test_stacked_uses.py, tests/test_formed_uses.py);
# 2. the bf16 table (benchmarks/bench_training_step.py) of the five GPU configurations (GPT-2 and
#    ViT with every use on the ghost path too);
# 3. a profile of the llama's DP-BiTFiT and bias-only steps (1.69x of bias-only on 2026-11-28: host
#    time), on the device (profile_step.py) and on the host (host_profile.py), and of GPT-2 T128's DP step;
# 4. the fp32 table of GPT-2 small T128, ViT-B/16 and ResNet-50-GN;
# 5. GPT-2 small T1024 in bf16 with --pairwise (every use ghost too), then the largest batches (--max-batch).
# Each step runs under `timeout` cut to what is left of SECONDS, so the call ends inside its limit
# and what finished comes back (re-tarred after each step): $OUT/device_log.txt and $OUT/results.tar.gz (the device tool
# returns at most 8 files). Wheels in .whl/ (dp-accounting and dm-tree: the device image lacks
# them) are installed to /tmp/site first; fetch them here once, and name .whl in the call's carry:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl dp-accounting==0.6.0 dm-tree
#
# BF16_CONFIGS / FP32_CONFIGS (space-separated) narrow steps 2 and 4 to what a call still needs;
# BF16_MODES replaces step 2's modes (e.g. add dpzoo-bk dpzoo-instantiate: the planner's choice against
# each path forced), PLAN_CONFIGS adds, after step 2, the planner's choices (benchmarks/plan_choices.py),
# GUARD_CONFIGS then the samples the clipped sums' guard sends to float64 (benchmarks/sum_guard_share.py,
# every use on the ghost path and the planner's plan).
#
# The device's own torch (2.11 on 2026-11-28) and transformers run the code: both in the supported range.
set -u
budget=${1:-480}
deadline=$((SECONDS + budget))
out=${OUT:-/tmp/gpu_checks}
res=/tmp/gpu_results
mkdir -p "$out" "$res"
log=$out/device_log.txt
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$log" 2>&1 || exit 1
    export PYTHONPATH=/tmp/site:$PWD  # the scripts import dpzoo from the checkout
fi

step() {  # step SECONDS CMD...: run CMD with at most SECONDS, never past the deadline
    local want=$1 left=$((deadline - SECONDS - 5))
    shift
    ((left < want)) && want=$left
    if ((want < 10)); then
        echo "=== skipped (deadline): $*" >>"$log"
        return
    fi
    echo "=== $* ($(date +%T), limit ${want}s)" >>"$log"
    timeout "$want" "$@" >>"$log" 2>&1
    echo "rc=$? $(date +%T)" >>"$log"
    tar -czf "$out/results.tar.gz" -C "$res" . 2>>"$log"  # after every step: a call cut short keeps what finished
}

{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null) $(git status --short 2>/dev/null | wc -l) changed files"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, timm; print(torch.__version__, transformers.__version__, timm.__version__)"
} >>"$log" 2>&1

bench=(python3 benchmarks/bench_training_step.py --device cuda --rounds 5 --steps 2 --warmup 2 --threads 8)
modes=(nonprivate-full nonprivate-bias dpzoo-bk-mixopt dpzoo-bitfit)
[ -n "${SKIP_TESTS:-}" ] || step 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_steps.py tests/test_mixed_precision.py tests/test_stacked_uses.py tests/test_formed_uses.py -k "cuda"
read -r -a bf16_modes <<<"${BF16_MODES:-${modes[*]}}"
for c in ${BF16_CONFIGS:-gpt2-small-t128 gpt2-small-t512 vit-base-patch16@224 resnet50-gn-bias@224 llama-bias-1b-t512}; do
    m=("${bf16_modes[@]}")
    # every use on the ghost path beside the planner's plan, where it fits (the stacked ghost path,
    # 2026-11-28, predicted 5.17x -> 2.97x on GPT-2 T128): not ResNet-50's 112² positions
    [[ -z ${BF16_MODES:-} && ($c == gpt2* || $c == vit*) ]] && m+=(dpzoo-bk)
    [[ $c == llama* ]] && m=("${modes[@]}")  # forced paths do not fit a 1.1B model's per-sample gradients
    step 90 "${bench[@]}" --precision bf16 --configs "$c" --modes "${m[@]}" --out "$res/bf16_${c//@/_}"
done
for c in ${PLAN_CONFIGS:-}; do
    step 60 python3 benchmarks/plan_choices.py "$c" --device cuda --precision bf16
done
for c in ${GUARD_CONFIGS:-}; do
    for m in dpzoo-bk dpzoo-bk-mixopt; do
        step 60 python3 benchmarks/sum_guard_share.py "$c" --mode "$m" --device cuda --precision bf16 \
            --out "$res/sum_guard_${c//@/_}_$m.json"
    done
done
step 150 python3 benchmarks/profile_step.py --device cuda --precision bf16 --configs llama-bias-1b-t512 \
    --modes nonprivate-bias dpzoo-bitfit --steps 2 --top 30 --out "$res/profile_llama-bias-1b-t512"
# wall-clock timers on every thread (cProfile sees the main thread; the backward's hooks run on autograd's)
timers=(dpzoo.grad_norms.copy_inert:CopyInert.__call__ dpzoo.grad_norms.capture:_record_output_grad
    dpzoo.grad_norms.ghost:ghost_differentiate dpzoo.grad_norms.audit:count_edges dpzoo.grad_norms.assembly:assemble
    dpzoo.privacy.optimizer:DPOptimizer.pre_step dpzoo.privacy.model_walk:named_modules)
for m in nonprivate-bias dpzoo-bitfit; do  # the host's side of the llama's DP-BiTFiT step, by Python function
    step 45 python3 benchmarks/host_profile.py llama-bias-1b-t512 "$m" --device cuda --precision bf16 --out "$res/host" \
        --time "${timers[@]}"
done
step 60 python3 benchmarks/profile_step.py --device cuda --precision bf16 --configs gpt2-small-t128 \
    --modes nonprivate-full dpzoo-bk-mixopt --steps 2 --top 30 --out "$res/profile_gpt2-small-t128"
for c in ${FP32_CONFIGS:-gpt2-small-t128 vit-base-patch16@224 resnet50-gn-bias@224}; do
    step 75 "${bench[@]}" --precision fp32 --configs "$c" --modes "${modes[@]}" --out "$res/fp32_${c//@/_}"
done
# with every use ghost too: at T1024 in bf16 the sums' guard sends most samples to float64 sums (session 23)
step 100 "${bench[@]}" --precision bf16 --pairwise --configs gpt2-small-t1024 --modes "${modes[@]}" dpzoo-bk \
    --out "$res/bf16_gpt2-small-t1024"
step 120 "${bench[@]}" --precision bf16 --no-memory --max-batch 256 --configs gpt2-small-t128 \
    --modes nonprivate-full dpzoo-bk-mixopt --out "$res/maxbatch_gpt2-small-t128"
tar -czf "$out/results.tar.gz" -C "$res" . 2>>"$log"
echo "done $(date +%T)" >>"$log"
