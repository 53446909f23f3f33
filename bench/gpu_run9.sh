# Device call B of 2026-11-30 (2x H200, ~8 min):
#  1. FP8 vs bf16 over 200 trainer steps at lr 3e-4 (loss logged every step), with bf16 eager
#     as the noise floor (same bf16 math, other kernels); bf16 eager at lr 3e-3 as the floor of
#     call A's pair (fp8 was 15 % off per step there)
#  2. one step's loss and gradient: fp32 vs bf16 vs bf16+fp8 (bench/fp8_grad_check.py)
#  3. kernel profiles: tp 2 + SP compiled with and without tp_comm_overlap; fp8 compiled
# Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
R="python3 -m mega_pretrain --model.size 1b-bench --train.seq_len 2048 --train.micro_batch_size 8 --train.global_batch_size 8 --train.steps 200 --train.log_interval 1 --train.eval_interval 0 --checkpoint.save_interval 0 --train.precision bf16 --run.out_dir /tmp/runs"
LO="--train.lr 3e-4 --train.min_lr 3e-5"
CUDA_VISIBLE_DEVICES=0 run 250 $R $LO --train.compile true --run.name bf16 &
CUDA_VISIBLE_DEVICES=0 run 250 $R $LO --train.compile false --run.name bf16-eager &
CUDA_VISIBLE_DEVICES=1 run 250 $R $LO --train.compile true --train.fp8 true --run.name fp8 &
CUDA_VISIBLE_DEVICES=1 run 250 $R --train.compile false --run.name bf16-eager-hi &
wait
for r in bf16 bf16-eager fp8 bf16-eager-hi; do cp /tmp/runs/$r/metrics.jsonl $OUT/$r-metrics.jsonl; done
python3 bench/compare_runs.py /tmp/runs/bf16 /tmp/runs/bf16-eager /tmp/runs/fp8 | tee -a $L
python3 bench/compare_runs.py /tmp/runs/bf16-eager-hi | tee -a $L
run 100 python3 bench/fp8_grad_check.py --size 1b-bench --mb 2 &
CUDA_VISIBLE_DEVICES=1 run 100 python3 bench/kernel_profile.py --steps-run 5 --label fp8 -- bench/mega_step.py --size 1b-bench --mb 8 --compile --fp8 --steps 3 --warmup 2 &
wait
P="torchrun --nproc-per-node 2 bench/kernel_profile.py --steps-run 5"
M="bench/mega_step.py --size 1b-bench --mb 8 --tp 2 --sp --compile --steps 3 --warmup 2"
run 110 $P --label tp2 -- $M
run 110 $P --label tp2_overlap -- $M --tp-comm-overlap
grep -E "Error|error" $L | tail -3
python3 bench/side_by_side.py $OUT
