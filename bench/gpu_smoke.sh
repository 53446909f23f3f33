export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$(ls -d packages/*/src apps/*/src | paste -sd:)
python3 -c "import torch,sys; print(torch.__version__, sys.version, torch.cuda.device_count())"
python3 -c "import pytest, xdist; print('pytest', pytest.__version__, 'xdist ok')" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -m pytest -p mega_parallel_grid.testing.pytest_plugin packages/parallel-grid/tests/test_harness.py packages/parallel-grid/tests/test_groups.py -q 2>&1 | tail -5
python3 bench/harness_overhead.py 2>&1 | tail -6
python3 anchors/ceiling.py 2>&1 | tail -3
