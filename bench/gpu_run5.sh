# One device call (2x H200): 8b (Llama-3-8B shape, seq 8192) at tp2+SP and at dp2 with full
# recompute; 1b-bench dp2 after the step changes; NCCL runs of the hybrid-MoE and estimate tests.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
export PYTORCH_ALLOC_CONF=expandable_segments:True
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
PT="python3 -m pytest -p mega_parallel_grid.testing.pytest_plugin -q -p no:cacheprovider"
B="torchrun --nproc-per-node 2 bench/mega_step.py --compile"
run 200 $B --size 8b --seq 8192 --mb 1 --tp 2 --sp --steps 5 --warmup 2
run 200 $B --size 8b --seq 8192 --mb 1 --recompute full --steps 5 --warmup 2
run 90 $B --size 1b-bench --mb 8 --steps 10 --warmup 3
run 60 $PT packages/models/tests/test_hybrid_moe.py apps/pretrain/tests/test_hybrid_moe_train.py apps/pretrain/tests/test_estimate.py
grep -E "passed|failed|Error|error" $L | tail -6
nvidia-smi --query-gpu=memory.used --format=csv
python3 bench/side_by_side.py $OUT
