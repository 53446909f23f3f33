# One short device call (2x H200): tp 2 + SP on 1b-bench, eager, without and with
# tp_comm_overlap (same call, A/B); pp 2 with the uneven split 13/11 (bubble was 14.7 % at 12/12).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
L=$OUT/log.txt
run() { local to=$1; shift; echo "=== $*" >>$L; timeout $to "$@" >>$L 2>&1; echo "=== rc=$? $*" | tee -a $L; }
B="torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --tp 2 --sp --steps 6 --warmup 2"
run 50 $B
run 50 $B --tp-comm-overlap
P="torchrun --nproc-per-node 2 bench/mega_step.py --size 1b-bench --mb 8 --pp 2 --accum 8 --compile --steps 6 --warmup 2"
run 90 $P --pp-layers 13,11   # the head and loss make the last stage ~1.1 layers heavier
grep -E "Error|error" $L | tail -3
grep "^RESULT" $L | python3 -c "
import sys, json
for line in sys.stdin:
    r = json.loads(line.split(' ', 1)[1]); print(r['system'], 'tp', r['tp'], 'pp', r['pp'], r.get('pp_layers'), 'overlap', r.get('tp_comm_overlap'), round(r['tokens_per_s_per_gpu']), round(r['step_ms_median'], 1))"
