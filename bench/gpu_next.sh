# The next device call (2x H200), everything this session could not measure, in one run (~9 min):
#  1. 1b-bench one GPU, eager and compiled, mega vs plain (q/k/v split, fp8 operand reuse landed unmeasured)
#  2. tp 2 + SP with and without tp_comm_overlap (eager, A/B in the same call)
#  3. pp 2 with the uneven split 13/11 (bubble was 14.7 % at 12/12)
#  4. FP8 vs bf16 over 200 trainer steps on the stdlib corpus: the loss within 1 %?
# Needs anchors/ carried (copy ../shared/anchors into the ignored anchors/ folder). Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
S="--steps 10 --warmup 3"
run 40 python3 anchors/ceiling.py
run 45 python3 bench/mega_step.py --size 1b-bench --mb 8 $S
run 45 python3 anchors/torch_ref.py --mb 8 $S
run 80 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile $S
run 80 python3 anchors/torch_ref.py --mb 8 --compile $S
run 90 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile --fp8 $S
T="torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --steps 6 --warmup 2"
run 50 $T --tp 2 --sp
run 50 $T --tp 2 --sp --tp-comm-overlap
run 100 $T --pp 2 --accum 8 --compile --pp-layers 13,11
R="python3 -m mega_pretrain --model.size 1b-bench --train.seq_len 2048 --train.micro_batch_size 8 --train.global_batch_size 8 --train.steps 200 --train.log_interval 10 --train.eval_interval 0 --checkpoint.save_interval 0 --train.precision bf16 --train.compile true --run.out_dir /tmp/runs"
CUDA_VISIBLE_DEVICES=0 run 150 $R --run.name bf16 &
CUDA_VISIBLE_DEVICES=1 run 150 $R --train.fp8 true --run.name fp8 &
wait
python3 bench/compare_runs.py /tmp/runs/bf16 /tmp/runs/fp8 | tee -a $L
grep -E "Error|error" $L | tail -3
python3 bench/side_by_side.py $OUT
