# One device call (1x H200): after the RoPE/SwiGLU backward change: mega and plain eager and
# compiled on 1b-bench mb 8, side by side; the FP8 linear bench. Table last.
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
S="--steps 10 --warmup 3"
run 40 python3 bench/mega_step.py --size 1b-bench --mb 8 $S
run 40 python3 anchors/torch_ref.py --mb 8 $S
run 80 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile $S
run 70 python3 anchors/torch_ref.py --mb 8 --compile $S
run 30 python3 bench/fp8_linear.py
grep -E "^RESULT.*fp8_linear|_scaled_mm vs" $L | cut -c1-400
echo '{"tflops_median": 787.1}' > $OUT/ceiling.json
python3 bench/side_by_side.py $OUT
