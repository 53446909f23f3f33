# Device call E of 2026-11-30 (1x H200, ~3 min): the bf16 noise floor at global batch 32 for
# call C's FP8 loss check: the same bf16 run with micro-batch 4 x 8 instead of 8 x 4 (same
# tokens, same updates up to the order of the sums), the 150-step schedule cut by the timeout (~110 steps), compared with call C's bf16.
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
timeout 150 python3 -m mega_pretrain --model.size 1b-bench --train.seq_len 2048 --train.micro_batch_size 4 --train.global_batch_size 32 --train.steps 150 --train.log_interval 1 --train.eval_interval 0 --checkpoint.save_interval 0 --train.precision bf16 --train.compile true --train.lr 3e-4 --train.min_lr 3e-5 --run.out_dir /tmp/runs --run.name bf16-gb32-mb4 > $OUT/log.txt 2>&1
echo rc=$?; cp /tmp/runs/bf16-gb32-mb4/metrics.jsonl $OUT/bf16-gb32-mb4-metrics.jsonl; tail -3 $OUT/log.txt
