# One device call (2x H200): mega vs plain PyTorch on one GPU (issue 10 shape), mega at dp2/tp2,
# NCCL tests of zero-optim and models, the zero-optim overlap bench. Table last.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
PT="python3 -m pytest -p mega_parallel_grid.testing.pytest_plugin -q -p no:cacheprovider"
S="--steps 10 --warmup 3"
run 110 python3 bench/mega_step.py --size 1b-bench --mb 8 --compile $S
run 100 python3 anchors/torch_ref.py --mb 8 --compile $S
run 60 $PT packages/zero-optim/tests -x
run 50 torchrun --nproc-per-node 2 bench/zero_overlap.py
run 100 torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --compile $S
run 50 python3 bench/mega_step.py --size 1b-bench --mb 8 $S
run 45 python3 anchors/torch_ref.py --mb 8 $S
grep -E "passed|failed" $L | tail -3
grep -A14 "^|" $L | tail -16
grep "^RESULT" $L | python3 -c "
import sys, json
print(f\"{'system':<22}{'mb':>3}{'tp':>3}{'dp':>3}{'tok/s/gpu':>11}{'step ms':>9}{'GiB':>7}{'MFU770':>8}{'MFU989':>8}\")
for line in sys.stdin:
    r = json.loads(line.split(' ',1)[1]); w = r.get('world',1)
    tps = r.get('tokens_per_s_per_gpu', r['tokens_per_s']); f = r.get('flops_per_token', 9.0e9)
    tf = tps * f / 1e12
    name = r['system'] + ('-compile' if r.get('compile') is True else ('-eager' if r.get('compile') is False else ''))
    print(f\"{name:<22}{r['mb']:>3}{r.get('tp',1):>3}{r.get('dp',1):>3}{tps:>11.0f}{r['step_ms_median']:>9.1f}{r.get('peak_alloc_gib',0):>7.1f}{tf/770.1:>8.1%}{tf/989:>8.1%}\")
"
