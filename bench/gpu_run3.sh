# One device call (2x H200): the trainer itself (1b at dp2, then resumed at tp2 from that
# checkpoint), MoE on NCCL (tests + trainer --ep 2), hybrid tests on NCCL, tp2+SP and pp2 step
# benches of 1b-bench. Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
PT="python3 -m pytest -p mega_parallel_grid.testing.pytest_plugin -q -p no:cacheprovider"
TR="torchrun --nproc-per-node 2 -m mega_pretrain --config configs/1b.toml --run.out_dir /tmp/runs --run.name 1b-gpu --train.global_batch_size 16 --train.log_interval 10 --train.eval_interval 0 --checkpoint.save_interval 0"
run 150 $TR --train.steps 40
run 150 $TR --train.steps 80 --tp 2
run 100 $PT packages/moe/tests packages/models/tests/test_gpt_moe.py packages/zero-optim/tests/test_ddp_filter.py tests/test_moe_training.py
run 80 torchrun --nproc-per-node 2 -m mega_pretrain --config configs/mixtral-tiny.toml --ep 2 --train.steps 20 --run.out_dir /tmp/runs --run.name mixtral-ep2
run 60 $PT packages/models/tests/test_hybrid.py packages/models/tests/test_mamba.py packages/models/tests/test_ssd.py
S="--steps 10 --warmup 3 --compile"
run 100 torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --tp 2 --sp $S
run 100 torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --pp 2 --accum 8 $S
grep -E "passed|failed|error" $L | tail -8
grep -E "^step|^done|stopped|Traceback|Error" $L | tail -30
cp /tmp/runs/1b-gpu/metrics.jsonl $OUT/1b-gpu-metrics.jsonl 2>/dev/null; cp /tmp/runs/mixtral-ep2/metrics.jsonl $OUT/mixtral-ep2-metrics.jsonl 2>/dev/null
grep "^RESULT" $L
