# Issue 11 on nvidia-h200-x8 (8x H200), one part per device call (each < 10 min):
#   bash bench/gpu_x8_issue11.sh scaling   # 1b at dp 1/2/4/8 and the bubble at p 4 and 8
#   bash bench/gpu_x8_issue11.sh 8b        # 8b tp2·pp2·dp2 vpp2 for 50 steps, then tp4·dp2; losses compared
#   bash bench/gpu_x8_issue11.sh reshard   # 1b saved at tp2·pp2·dp2, resumed at dp8 and at tp4·dp2
# Run from the repository root on the device; logs and JSON under $OUT; a short table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
step() { local n=$1; shift; run 150 torchrun --nproc-per-node $n bench/mega_step.py --compile --steps 10 --warmup 3 "$@"; }
TR="torchrun --nproc-per-node 8 -m mega_pretrain --run.out_dir /tmp/runs --train.eval_interval 0 --checkpoint.save_interval 0"
case ${1:-scaling} in
scaling)
  for n in 1 2 4 8; do step $n --size 1b --mb 8; done
  step 4 --size 1b-bench --mb 8 --pp 4 --accum 16
  step 8 --size 1b-bench --mb 4 --pp 8 --accum 32
  python3 bench/side_by_side.py $OUT ;;
8b)
  C="--config configs/8b.toml --train.steps 50 --train.global_batch_size 16 --train.log_interval 5 --train.compile true"
  run 280 $TR $C --run.name 8b-tp2pp2dp2
  run 280 $TR $C --tp 4 --pp 1 --parallel.vpp none --run.name 8b-tp4dp2
  python3 bench/compare_runs.py /tmp/runs/8b-tp2pp2dp2 /tmp/runs/8b-tp4dp2 | tee -a $L ;;
reshard)
  C="--config configs/1b.toml --train.global_batch_size 64 --train.log_interval 10 --run.name 1b-reshard"
  run 200 $TR $C --tp 2 --pp 2 --train.steps 40
  cp -r /tmp/runs/1b-reshard /tmp/runs/1b-reshard-copy
  run 150 $TR $C --train.steps 60
  run 150 $TR $C --tp 4 --train.steps 60 --run.name 1b-reshard-copy
  python3 bench/compare_runs.py /tmp/runs/1b-reshard /tmp/runs/1b-reshard-copy | tee -a $L ;;
esac
grep -E "^step|^done|Error|error" $L | tail -12
