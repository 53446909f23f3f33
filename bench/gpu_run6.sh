# One device call (1x H200): side by side again after the step changes (mega / plain PyTorch,
# compiled and eager, 1b-bench mb 8), FP8: the linear bench and mega's step with --fp8;
# kernel profiles of mega and plain eager. Table last.
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
S="--steps 10 --warmup 3"
run 40 python3 anchors/ceiling.py
run 60 python3 bench/fp8_linear.py
run 100 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile $S
run 100 python3 anchors/torch_ref.py --mb 8 --compile $S
run 110 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile --fp8 $S
run 50 python3 bench/mega_step.py --size 1b-bench --mb 8 $S
run 50 python3 anchors/torch_ref.py --mb 8 $S
mkdir -p /tmp/p; P="python3 bench/kernel_profile.py --steps-run 4"
OUT=/tmp/p run 45 $P --label mega-eager -- bench/mega_step.py --size 1b-bench --mb 8 --steps 2 --warmup 2
OUT=/tmp/p run 45 $P --label plain-eager -- anchors/torch_ref.py --mb 8 --steps 2 --warmup 2
cp /tmp/p/profile_*.txt $OUT/ 2>/dev/null
grep -E "^RESULT|fp8|FP8" $L | grep -v '"system": "mega-\|plain' | tail -6
python3 bench/side_by_side.py $OUT
