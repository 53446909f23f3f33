# Device call C of 2026-11-30 (2x H200, ~8 min):
#  1. tp 2 + SP (eager) under CUDA_DEVICE_MAX_CONNECTIONS=1 and NCCL_PROTO=Simple, A/B/C/D
#  2. FP8 with the forward GEMM's fast accumulation (new default) vs bf16, compiled, one per GPU
#  3. FP8 vs bf16 loss at global batch 32 (4 micro-batches of 8), 150 steps, lr 3e-4, one per GPU
# Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
T="torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --steps 8 --warmup 2 --tp 2 --sp"
run 45 $T
CUDA_DEVICE_MAX_CONNECTIONS=1 run 45 $T
NCCL_PROTO=Simple run 45 $T
CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_PROTO=Simple run 45 $T
S="--size 1b-bench --mb 8 --compile --steps 10 --warmup 3"
CUDA_VISIBLE_DEVICES=0 run 100 python3 bench/mega_step.py $S &
CUDA_VISIBLE_DEVICES=1 run 100 python3 bench/mega_step.py $S --fp8 &
wait
R="python3 -m mega_pretrain --model.size 1b-bench --train.seq_len 2048 --train.micro_batch_size 8 --train.global_batch_size 32 --train.steps 150 --train.log_interval 1 --train.eval_interval 0 --checkpoint.save_interval 0 --train.precision bf16 --train.compile true --train.lr 3e-4 --train.min_lr 3e-5 --run.out_dir /tmp/runs"
CUDA_VISIBLE_DEVICES=0 run 260 $R --run.name bf16-gb32 &
CUDA_VISIBLE_DEVICES=1 run 260 $R --train.fp8 true --run.name fp8-gb32 &
wait
for r in bf16-gb32 fp8-gb32; do cp /tmp/runs/$r/metrics.jsonl $OUT/$r-metrics.jsonl; done
python3 bench/compare_runs.py /tmp/runs/bf16-gb32 /tmp/runs/fp8-gb32 | tee -a $L
grep -E "Error|error" $L | tail -3
python3 bench/side_by_side.py $OUT
