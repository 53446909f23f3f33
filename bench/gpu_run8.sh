# Device call A of 2026-11-30 (2x H200, ~7 min): what landed unmeasured, part 1.
#  1. eager 1b-bench, mega vs plain (the q/k/v split landed after the last eager run), + kernel profiles
#  2. tp 2 + SP with and without tp_comm_overlap (A/B in the same call)
#  3. pp 2 with the uneven split 13/11 (bubble was 14.7 % at 12/12)
#  4. FP8 vs bf16 over 200 trainer steps (loss within 1 %?), one run per GPU, concurrently
# Needs anchors/ carried. Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
S="--steps 10 --warmup 3"
run 45 python3 bench/mega_step.py --size 1b-bench --mb 8 $S
run 45 python3 anchors/torch_ref.py --mb 8 $S
T="torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --steps 6 --warmup 2"
run 50 $T --tp 2 --sp
run 50 $T --tp 2 --sp --tp-comm-overlap
run 100 $T --pp 2 --accum 8 --compile --pp-layers 13,11
R="python3 -m mega_pretrain --model.size 1b-bench --train.seq_len 2048 --train.micro_batch_size 8 --train.global_batch_size 8 --train.steps 200 --train.log_interval 10 --train.eval_interval 0 --checkpoint.save_interval 0 --train.precision bf16 --train.compile true --run.out_dir /tmp/runs"
CUDA_VISIBLE_DEVICES=0 run 170 $R --run.name bf16 &
CUDA_VISIBLE_DEVICES=1 run 170 $R --train.fp8 true --run.name fp8 &
wait
python3 bench/compare_runs.py /tmp/runs/bf16 /tmp/runs/fp8 | tee -a $L
P="python3 bench/kernel_profile.py --steps-run 5"
run 55 $P --label mega_eager -- bench/mega_step.py --size 1b-bench --mb 8 --steps 3 --warmup 2 &
CUDA_VISIBLE_DEVICES=1 run 55 $P --label plain_eager -- anchors/torch_ref.py --mb 8 --steps 3 --warmup 2 &
wait
grep -E "Error|error" $L | tail -3
python3 bench/side_by_side.py $OUT
