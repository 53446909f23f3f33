# One device call: NCCL tests of grid, tp-layers, pipeline, models; tp/pipeline benches; GPT tp check.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
PT="python3 -m pytest -p mega_parallel_grid.testing.pytest_plugin -q -x -p no:cacheprovider"
for p in parallel-grid tp-layers pipeline models; do
  echo "== tests $p"; $PT packages/$p/tests 2>&1 | tail -3 | tee $OUT/tests_$p.txt
done
echo "== tp_mlp"; torchrun --nproc-per-node 2 bench/tp_mlp.py 2>&1 | tail -12 | tee $OUT/tp_mlp.txt
echo "== pipeline_bubble"; torchrun --nproc-per-node 2 bench/pipeline_bubble.py 2>&1 | tail -14 | tee $OUT/pipeline_bubble.txt
echo "== gpt_tp_check"; torchrun --nproc-per-node 2 bench/gpt_tp_check.py 2>&1 | tail -5 | tee $OUT/gpt_tp_check.txt
