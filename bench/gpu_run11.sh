# Device call D of 2026-11-30 (2x H200, ~6 min): where tp 2 loses against dp 2, compiled.
#  ceiling; tp 2 + SP and dp 2 step (compiled, unprofiled); tp 2 + SP kernel profile over
#  13 steps (compile's autotuning spread thin). Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
run 35 python3 anchors/ceiling.py
M="bench/mega_step.py --size 1b-bench --mb 8 --compile"
run 90 torchrun --nproc-per-node 2 $M --tp 2 --sp --steps 8 --warmup 3
run 90 torchrun --nproc-per-node 2 $M --steps 8 --warmup 3
run 130 torchrun --nproc-per-node 2 bench/kernel_profile.py --steps-run 13 --label tp2 -- $M --tp 2 --sp --steps 10 --warmup 3
grep -E "Error|error" $L | tail -3
python3 bench/side_by_side.py $OUT
