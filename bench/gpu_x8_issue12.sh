# Issue 12 on nvidia-h200-x8 (8x H200), one part per device call (each < 10 min):
#   bash bench/gpu_x8_issue12.sh mixtral    # moe-2b (16 experts, top-2) at ep 1, 2, 4, 8 over dp 8: 20 steps each
#   bash bench/gpu_x8_issue12.sh deepseek   # deepseek-3b (64 experts, top-6, shared, aux-free) at ep 8, tp 2, etp 1
# Same global batch and data in every run, so the losses compare step by step; per-expert
# load (imbalance = max/mean) is logged by the trainer. Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
TR="torchrun --nproc-per-node 8 -m mega_pretrain --run.out_dir /tmp/runs --train.eval_interval 0 --checkpoint.save_interval 0 --train.precision bf16 --train.compile true --train.seq_len 4096 --train.micro_batch_size 2 --train.global_batch_size 16 --train.log_interval 2"
case ${1:-mixtral} in
mixtral)
  for ep in 1 2 4 8; do run 130 $TR --model.size moe-2b --ep $ep --train.steps 20 --run.name moe2b-ep$ep; done
  python3 bench/compare_runs.py /tmp/runs/moe2b-ep1 /tmp/runs/moe2b-ep2 /tmp/runs/moe2b-ep4 /tmp/runs/moe2b-ep8 | tee -a $L ;;
deepseek)
  run 250 $TR --model.size deepseek-3b --ep 8 --tp 2 --etp 1 --parallel.sequence_parallel true --train.steps 100 --run.name ds3b-ep8
  # the all-to-all's share of the step: NCCL kernel time per step (rank 0's profile)
  run 200 torchrun --nproc-per-node 8 bench/kernel_profile.py --steps-run 5 --label ds3b-ep8 -- bench/mega_step.py --size deepseek-3b --seq 4096 --mb 2 --ep 8 --tp 2 --etp 1 --sp --compile --steps 3 --warmup 2
  head -12 $OUT/profile_ds3b-ep8.txt | tee -a $L
  python3 bench/compare_runs.py /tmp/runs/ds3b-ep8 | tee -a $L ;;
esac
grep -E "Error|error" $L | tail -5
