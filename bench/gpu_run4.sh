# One device call (1x H200): the issue-10 side by side on the anchors' shape (1b-bench, mb 8):
# ceiling, mega / plain PyTorch compiled and eager, megatron-core as shipped and with SDPA +
# fused AdamW; then kernel profiles of mega and plain compiled. Needs carry [".snap"] with
# .whl (megatron-core wheel) and anchors inside. Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:):/tmp/site
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
S="--steps 10 --warmup 3"
run 40 python3 anchors/ceiling.py
run 100 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile $S
run 100 python3 anchors/torch_ref.py --mb 8 --compile $S
run 50 python3 bench/mega_step.py --size 1b-bench --mb 8 $S
run 50 python3 anchors/torch_ref.py --mb 8 $S
run 60 python3 anchors/mcore_bench.py --mb 4 --attn local $S
run 60 python3 anchors/mcore_bench.py --mb 8 --attn sdpa --fused-adam $S
cp $OUT/results.jsonl $OUT/results.keep
mkdir -p /tmp/p; P="python3 bench/kernel_profile.py --steps-run 5"
OUT=/tmp/p run 90 $P --label mega-compile -- bench/mega_step.py --size 1b-bench --mb 8 --compile --steps 3 --warmup 2
OUT=/tmp/p run 90 $P --label plain-compile -- anchors/torch_ref.py --mb 8 --compile --steps 3 --warmup 2
cp /tmp/p/profile_*.txt $OUT/ 2>/dev/null
grep -A12 "^== " $L | head -60
python3 bench/side_by_side.py $OUT
