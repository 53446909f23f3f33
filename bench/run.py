"""One device call per suite: every benchmark of the suite in its own process, one table last.

On the GPU machine, from the repository root (no uv there; the source tree is the install):

    python3 bench/run.py families          # every model family through train.compile
    python3 bench/run.py moe single        # several suites, one after another
    python3 bench/run.py --list            # the suites and their commands

Each command runs with its own timeout (one failure or OOM does not stop the rest); its
output goes to ``$OUT/<suite>.log`` (``--out DIR`` or $OUT, default /tmp/bench_out) and
its JSON result line to ``$OUT/results.jsonl``. The last thing printed is the table of
``bench/side_by_side.py`` over that folder, then one line per command with its status.
The peers are the project's own (``bench/peers/``: the plain-PyTorch reference, the
megatron-core driver, the matmul ceiling); megatron-core travels as a wheel (see
``bench/RESULTS.md``), and its lines fail alone where it is missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (label, timeout in s, command) per suite; commands run from the repository root
Suite = list[tuple[str, int, str]]

_STEP = "python3 bench/mega_step.py"
_TORCH = "python3 bench/peers/torch_ref.py"
_CEILING = "python3 bench/peers/ceiling.py"
_TORCHRUN2 = "torchrun --standalone --nproc-per-node 2"


def _fp8_recipe_step(recipe: str, timeout: int = 110) -> tuple[str, int, str]:
    """``1b-bench`` compiled with FP8 GEMMs scaled by ``recipe`` (tensor, row or block)."""
    return (f"mega compile fp8 {recipe}", timeout,
            f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --set train.fp8_recipe={recipe} "
            "--steps 10 --warmup 3")  # fmt: skip


_TRAIN = (
    "python3 -m mega_pretrain --train.compile true --train.steps 12 --train.log_interval 4 "
    "--train.eval_interval 0 --checkpoint.save_interval 0 --run.out_dir /tmp/runs"
)

SUITES: dict[str, Suite] = {
    "ceiling": [("ceiling", 60, _CEILING)],
    "families": [
        ("moe-2b compile", 240, f"{_STEP} --size moe-2b --mb 4 --compile"),
        ("deepseek-3b compile", 240, f"{_STEP} --size deepseek-3b --mb 4 --compile"),
        ("trainer gpt 125m", 150, f"{_TRAIN} --model.size 125m --run.name f-gpt"),
        ("trainer moe-2b", 200, f"{_TRAIN} --model.size moe-2b --train.micro_batch_size 4 "
                                "--train.global_batch_size 4 --run.name f-moe"),
        ("trainer hybrid-1b", 200, f"{_TRAIN} --model.size hybrid-1b --train.micro_batch_size 2 "
                                   "--train.global_batch_size 2 --run.name f-hybrid"),
        ("trainer hybrid-moe-tiny", 150, f"{_TRAIN} --model.size hybrid-moe-tiny --run.name f-hmoe"),
    ],
    "moe": [
        ("moe-2b eager", 180, f"{_STEP} --size moe-2b --mb 4"),
        ("moe-2b compile", 240, f"{_STEP} --size moe-2b --mb 4 --compile"),
        ("deepseek-3b eager", 180, f"{_STEP} --size deepseek-3b --mb 4"),
        ("deepseek-3b compile", 240, f"{_STEP} --size deepseek-3b --mb 4 --compile"),
        # the DeepSeek-V3-shaped size as it met target 3 (35.4 %, 2026-12-07): mb 4 x 8 fits
        # an H100 with the allocator's expandable segments (76.3 GiB; 62.5 with bf16 moments)
        ("deepseek-v3-3b accum 8", 200,
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
         f"{_STEP} --size deepseek-v3-3b --mb 4 --accum 8 --compile --steps 3 --warmup 2"),
    ],
    "single": [
        ("ceiling", 60, _CEILING),
        ("mega compile", 180, f"{_STEP} --size 1b-bench --mb 8 --compile"),
        ("mega eager", 150, f"{_STEP} --size 1b-bench --mb 8"),
        ("torch compile", 180, f"{_TORCH} --mb 8 --compile"),
        ("torch bf16 compile", 180, f"{_TORCH} --mb 8 --compile --precision bf16"),
        ("torch eager", 150, f"{_TORCH} --mb 8"),
    ],
    # issue 22's side-by-side in one call (~600 s; carry .whl with liger-kernel's wheel): the
    # ceiling, mega compiled bf16 and FP8 (tensor-, row-, block-wise) beside the plain-PyTorch
    # references and Liger, the hybrid beside GPT, the two MoE sizes accumulating 4
    # micro-batches a step
    "target22": [
        ("ceiling", 60, _CEILING),
        ("mega compile", 150, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 10 --warmup 3"),
        ("mega compile fp8", 150, f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --steps 10 "
                                  "--warmup 3"),
        *[_fp8_recipe_step(recipe) for recipe in ("row", "block")],
        ("torch compile", 150, f"{_TORCH} --mb 8 --compile --steps 10 --warmup 3"),
        ("torch bf16 compile", 150, f"{_TORCH} --mb 8 --compile --precision bf16 --steps 10 "
                                    "--warmup 3"),
        ("torch liger eager", 150,
         "python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "
         ".whl/liger_kernel-*.whl && PYTHONPATH=/tmp/site:$PYTHONPATH "
         f"{_TORCH} --mb 8 --liger --steps 10 --warmup 3"),
        ("hybrid vs gpt", 300, "python3 bench/hybrid_vs_gpt.py --compile"),
        *[
            (f"{size} accum 4", 200, f"{_STEP} --size {size} --mb 4 --accum 4 --compile "
                                     "--steps 6 --warmup 2")
            for size in ("moe-2b", "deepseek-3b")
        ],
    ],
    # plain PyTorch with Liger Kernel's Triton kernels (carry .whl with liger-kernel's wheel)
    "liger": [
        (f"torch liger {mode}", 180,
         "python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "
         ".whl/liger_kernel-*.whl && PYTHONPATH=/tmp/site:$PYTHONPATH "
         f"{_TORCH} --mb 8 --liger{' --compile' if mode == 'compile' else ''}")
        for mode in ("eager", "compile")
    ],
    "peers": [
        ("mcore as shipped", 150, "python3 bench/peers/mcore.py --mb 4"),
        ("mcore sdpa fused", 150, "python3 bench/peers/mcore.py --mb 8 --sdpa --fused-adam"),
    ],
    "fp8": [
        ("mega compile", 180, f"{_STEP} --size 1b-bench --mb 8 --compile"),
        ("mega compile fp8", 180, f"{_STEP} --size 1b-bench --mb 8 --compile --fp8"),
    ],
    "hybrid": [("hybrid vs gpt", 400, "python3 bench/hybrid_vs_gpt.py --compile")],
    # the SSD scan alone at hybrid-1b's mixer shape: ssd_triton beside ssd_chunked and mamba_ssm
    "ssd": [
        ("ssd kernel tests", 400, "python3 -m pytest -q packages/models/tests/test_ssd_triton.py"),
        ("ssd kernels", 400, "python3 bench/ssd_kernels.py"),
    ],
    # the mixer's conv + SiLU and gated norm alone at hybrid-1b's shape: Triton vs torch eager/compiled
    "mixer": [
        ("mixer kernel tests", 400, "python3 -m pytest -q packages/models/tests/test_mixer_triton.py"),
        ("mixer kernels", 400, "python3 bench/mixer_kernels.py"),
        ("hybrid vs gpt", 400, "python3 bench/hybrid_vs_gpt.py --compile"),
    ],
    # the 2026 families (issue 19): compiled, bf16 and bf16 + FP8 GEMMs
    "families19": [
        (f"{size} compile{' fp8' if fp8 else ''}", 300,
         f"{_STEP} --size {size} --mb {mb} --compile{' --fp8' if fp8 else ''}")
        for size, mb, fp8 in (
            ("deepseek-v3-3b", 4, False), ("qwen3-1.7b", 8, False), ("nemotron-h-1b", 4, False),
            ("deepseek-v3-3b", 4, True), ("qwen3-1.7b", 8, True),
        )
    ],
    # the 2026 families through the trainer itself (compiled, bf16 from auto), causality on the GPU
    "train19": [
        ("causality", 240, "python3 bench/causality_check.py"),
        *[
            (f"trainer {size}", 240,
             f"{_TRAIN} --model.size {size} --train.micro_batch_size {mb} "
             f"--train.global_batch_size {mb} --run.name t-{size}")
            for size, mb in (("deepseek-v3-3b", 4), ("qwen3-1.7b", 4), ("nemotron-h-1b", 4))
        ],
    ],
    # this session's GPU-only paths: causality, the CUDA-only tests, document masking, the trainer
    "gpu-paths": [
        ("causality", 200, "python3 bench/causality_check.py --sizes 1b-bench,deepseek-v3-3b,nemotron-h-1b"),
        ("cuda tests", 300, "python3 -m pytest -q "
                            "packages/models/tests/test_mla.py::test_latent_sdpa_padded_on_cuda_matches_fp32 "
                            "apps/pretrain/tests/test_async_checkpoint.py::test_staging_from_the_gpu_into_pinned_buffers "
                            "packages/models/tests/test_doc_mask.py"),
        ("doc attention", 200, "python3 bench/doc_attention.py"),
        *[
            (f"trainer {size}", 240,
             f"{_TRAIN} --model.size {size} --train.micro_batch_size {mb} "
             f"--train.global_batch_size {mb} --run.name t-{size}")
            for size, mb in (("deepseek-v3-3b", 4), ("nemotron-h-1b", 4))
        ],
    ],
    # the step stall of a checkpoint save of the 1b model, sync vs async (checkpoint.async_save):
    # two saves 150 steps (~25-40 s) apart, so the second async save finds the first one's write done
    "ckpt-stall": [
        (f"1b save {mode}", 240,
         "python3 -m mega_pretrain --model.size 1b --train.seq_len 2048 --train.micro_batch_size 4 "
         "--train.global_batch_size 4 --train.steps 300 --train.log_interval 50 "
         "--train.eval_interval 0 --checkpoint.save_interval 150 "
         f"--checkpoint.async_save {str(mode == 'async').lower()} --run.out_dir /tmp/runs --run.name s-{mode}")
        for mode in ("sync", "async")
    ],
    # GPU kernel time by kind per step (bench/kernel_profile.py), compiled
    "profile": [
        (f"profile {size}", 300, f"python3 bench/kernel_profile.py --steps-run 8 --label {size} -- "
                                 f"{_STEP.split(' ', 1)[1]} --size {size} --mb {mb} --compile "
                                 "--steps 5 --warmup 3")
        for size, mb in (("moe-2b", 4), ("deepseek-3b", 4), ("1b-bench", 8))
    ],
    # CUDA graphs (train.compile_mode reduce-overhead) against the default compile: 125m is
    # launch-bound, 1b-bench is not; and the CUDA-only test that graphs train like the default
    "graphs": [
        *[
            (f"{size} {mode}", 300, f"{_STEP} --size {size} --mb {mb} --compile "
                                    f"--set train.compile_mode={mode}")
            for size, mb in (("125m", 8), ("1b-bench", 8))
            for mode in ("default", "reduce-overhead")
        ],
        ("graphs test", 200, "python3 -m pytest -q apps/pretrain/tests/test_compile_mode.py"),
    ],
    # issue 22 target 6: today's head vs the fused linear + cross-entropy (train.loss_chunk_size),
    # alone at vocab 32k and 128k, then in the 1b-bench step
    "linear-ce": [
        ("fused ce tests", 300, "python3 -m pytest -q -p mega_parallel_grid.testing.pytest_plugin "
                                "packages/tp-layers/tests/test_fused_cross_entropy.py"),
        ("linear-ce eager", 400, "python3 bench/linear_ce.py"),
        ("linear-ce compile", 500, "python3 bench/linear_ce.py --compile"),
        ("mega compile", 180, f"{_STEP} --size 1b-bench --mb 8 --compile"),
        ("mega compile fused ce", 180, f"{_STEP} --size 1b-bench --mb 8 --compile "
                                       "--set train.loss_chunk_size=4096"),
    ],
    # every test that skips without CUDA (18 in CI), on the GPU, and every Triton kernel's tests
    "cuda-tests": [
        ("cuda-only tests", 400, "python3 -m pytest -q -rs "
                                 "packages/zero-optim/tests/test_offload.py::test_offload_on_cuda "
                                 "packages/tp-layers/tests/test_fused_cross_entropy.py::test_fused_bf16_on_cuda_matches_fp32_and_holds_no_logits "
                                 "packages/models/tests/test_split_backward.py::test_norm_split_on_cuda "
                                 "packages/models/tests/test_mla.py::test_latent_sdpa_padded_on_cuda_matches_fp32 "
                                 "packages/models/tests/test_ssd_triton.py packages/models/tests/test_mixer_triton.py "
                                 "packages/zero-optim/tests/test_accumulate.py packages/moe/tests/test_wgrad_into_main_grad.py "
                                 "apps/pretrain/tests/test_compile_mode.py::test_cuda_graphs_train_like_the_default_mode "
                                 "apps/pretrain/tests/test_runtime.py::test_tf32_is_on_for_fp32_on_cuda "
                                 "apps/pretrain/tests/test_async_checkpoint.py::test_staging_from_the_gpu_into_pinned_buffers"),
    ],
    # the contract tests again on the GPU with NCCL (the pool uses NCCL when GPUs are visible)
    "gpu-tests": [
        ("parallel-grid tests", 300, "python3 -m pytest -q -p mega_parallel_grid.testing.pytest_plugin "
                                     "packages/parallel-grid/tests packages/tp-layers/tests/test_linear.py"),
    ],
    # the cost of the split backward (issue 23): fused B+W vs B then W from the store, one GPU
    "split": [
        ("split eager", 300, "python3 bench/split_backward.py --size 1b-bench --mb 8"),
        ("split compile", 420, "python3 bench/split_backward.py --size 1b-bench --mb 8 --compile"),
    ],
    # ZeRO stages on one GPU (issue 21): the overhead of parameter sharding at dp 1 (tokens/s,
    # peak memory; eager, since train.compile is refused under ZeRO-3), the compiled ZeRO-1
    # step for scale, and the trainer's CLI at ZeRO-3 through its end-of-run checkpoint
    "zero": [
        *[
            (f"1b-bench {stage}", 240, f"{_STEP} --size 1b-bench --mb 8 --steps 10 --warmup 3 "
                                       f"--set parallel.sharding={stage}")
            for stage in ("optimizer", "gradients", "parameters")
        ],
        ("1b-bench optimizer compile", 240, f"{_STEP} --size 1b-bench --mb 8 --compile"),
        *[
            (f"1b-bench {stage} offload", 300, f"{_STEP} --size 1b-bench --mb 8 --steps 10 --warmup 3 "
                                               f"--set parallel.sharding={stage} "
                                               "--set parallel.optimizer_offload=true")
            for stage in ("optimizer", "parameters")
        ],
        ("trainer 1b-bench zero3", 300,
         "python3 -m mega_pretrain --model.size 1b-bench --train.micro_batch_size 8 "
         "--train.global_batch_size 8 --train.seq_len 2048 --train.steps 12 "
         "--train.log_interval 4 --train.eval_interval 0 --checkpoint.save_interval 0 "
         "--parallel.sharding parameters --run.out_dir /tmp/runs --run.name z-zero3"),
    ],
    # the widest 1b-bench-deep model that trains at dp 1, with and without the offload (the
    # offload's host copy bounds it at the machine's memory: bench/zero_offload.py's guard)
    "zero-largest": [
        ("offload largest", 560, "python3 bench/zero_offload.py --find-largest --recompute full "
                                 "--warmup 1 --iters 2"),
    ],
    # what the sixth session left owed on one GPU (bench/NOTES.md, "Device runs owed"), in
    # the order of their worth: deepseek-3b's MFU accumulating 4 micro-batches a step, where
    # hybrid-1b's step and the conv's backward go, one compiled FP8 layer against eager and
    # compiled row-wise FP8's first step against fp32, the block
    # recipe's e4m3 GEMMs, the offload's clean exit, then the largest models
    "owed": [
        ("profile deepseek-3b accum 4", 150, f"{_STEP} --size deepseek-3b --mb 4 --accum 4 "
                                             "--compile --steps 4 --warmup 2 --profile 1"),
        ("profile hybrid-1b", 150, "python3 bench/hybrid_vs_gpt.py --compile --only hybrid "
                                   "--warmup 2 --iters 3 --profile"),
        ("mixer kernels", 200, "python3 bench/mixer_kernels.py"),
        ("fp8 compile check", 200, "python3 bench/fp8_compile_check.py --scalings tensor,row,block"),
        ("fp8 grad check compiled row", 300, "python3 bench/fp8_grad_check.py --size 1b-bench "
                                             "--mb 2 --recipes row --compile"),
        ("fp8 recipes", 200, "python3 bench/fp8_recipes.py --time --steps 20"),
        ("offload exit", 150, f"{_STEP} --size 1b-bench --mb 8 --steps 4 --warmup 2 "
                              "--set parallel.optimizer_offload=true"),
        ("offload largest", 560, "python3 bench/zero_offload.py --find-largest --recompute full "
                                 "--warmup 1 --iters 2"),
    ],
    # the seventh session's first look: deepseek-3b accumulating 4 micro-batches (target 3's
    # second model), where hybrid-1b's step goes by kind, one compiled FP8 layer against eager
    # per gradient (which GEMM compiled row-wise gets wrong), the conv backward's parts
    "probe7": [
        ("profile deepseek-3b accum 4", 150, f"{_STEP} --size deepseek-3b --mb 4 --accum 4 "
                                             "--compile --steps 4 --warmup 2 --profile 1"),
        ("profile hybrid-1b", 150, "python3 bench/hybrid_vs_gpt.py --compile --only hybrid "
                                   "--warmup 2 --iters 3 --profile"),
        ("fp8 compile check", 150, "python3 bench/fp8_compile_check.py --scalings tensor,row,block"),
        ("mixer kernels", 150, "python3 bench/mixer_kernels.py"),
    ],
    # the seventh session's second look: the new kernels on the GPU (the SSD scan's scores
    # computed once per group, the Triton main-grad accumulation), which piece of compiled
    # row-wise FP8 goes wrong and whether the opaque GEMM op mends it, the hybrid beside GPT,
    # deepseek-3b accumulating 4 micro-batches with the accumulation kernel
    "probe7b": [
        ("gpu kernel tests", 150, "python3 -m pytest -q -p no:cacheprovider "
                                  "packages/models/tests/test_ssd_triton.py "
                                  "packages/zero-optim/tests/test_accumulate.py"),
        ("fp8 row probe", 120, "python3 bench/fp8_row_probe.py"),
        ("hybrid vs gpt", 220, "python3 bench/hybrid_vs_gpt.py --compile"),
        ("profile deepseek-3b accum 4", 130, f"{_STEP} --size deepseek-3b --mb 4 --accum 4 "
                                             "--compile --steps 4 --warmup 2 --profile 1"),
        ("fp8 compile check", 100, "python3 bench/fp8_compile_check.py --scalings row,row:e4m3"),
        ("ssd kernels", 60, "python3 bench/ssd_kernels.py"),
    ],
    # the seventh session's last call (on the H200): the hybrid with the SSD scan before
    # (.snap/ssd_old: HEAD's packages/models/src) and after the scores change, beside GPT;
    # 1b-bench compiled bf16 against FP8 tensor- and block-wise
    # the eighth session's first call: the main-grad accumulation alone (ATen, Inductor, the
    # project's kernel) and deepseek-3b with it, compiled row-wise FP8 bisected by backend (AOT
    # graphs logged), FP8 with fixed scales (delayed scaling's bound), the old SSD scan
    "probe8": [
        ("grad accum deepseek-3b", 90, "python3 bench/grad_accum.py --size deepseek-3b --accum 4"),
        ("deepseek-3b accum 4", 200, f"{_STEP} --size deepseek-3b --mb 4 --accum 4 --compile "
                                     "--steps 6 --warmup 2"),
        ("fp8 row bisect small", 80, "TORCH_LOGS=aot_graphs python3 bench/fp8_row_probe.py "
                                     "--linear-only --m 256 --k 256 --n 256 --backends "
                                     "aot_eager,aot_eager_decomp_partition,inductor "
                                     "2> $OUT/fp8_row_graphs.log"),
        ("mega compile fp8", 110, f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --steps 10 "
                                  "--warmup 3"),
        ("fp8 fixed scale", 110, "python3 bench/fp8_fixed_scale.py --size 1b-bench --mb 8 "
                                 "--compile --fp8 --steps 10 --warmup 3"),
        ("hybrid old ssd", 150, "PYTHONPATH=.snap/ssd_old/packages/models/src:$PYTHONPATH "
                                "python3 bench/hybrid_vs_gpt.py --compile --only hybrid"),
    ],
    # the eighth session's second call: issue 22's table (target22's lines) with the hybrid
    # before/after the SSD scores change, FP8 with fixed scales, the row-wise FP8 trace checks
    # and deepseek-3b at 8 micro-batches
    "final8": [],
    "probe7c": [
        ("hybrid old ssd", 150, "PYTHONPATH=.snap/ssd_old/packages/models/src:$PYTHONPATH "
                                "python3 bench/hybrid_vs_gpt.py --compile --only hybrid"),
        ("hybrid vs gpt", 220, "python3 bench/hybrid_vs_gpt.py --compile"),
        ("mega compile", 110, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 10 --warmup 3"),
        ("mega compile fp8", 110, f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --steps 10 "
                                  "--warmup 3"),
        _fp8_recipe_step("block"),
    ],
    # the sixth session's first look: SDPA kernels alone, the mixer conv's backward profiled,
    # compiled row-wise FP8's causality, cuDNN attention in the step, MoE's kernel profile
    "probe": [
        ("attn kernels", 200, "python3 bench/attn_kernels.py"),
        ("mixer profile", 200, "python3 bench/kernel_profile.py --steps-run 25 --label mixer -- "
                               "bench/mixer_kernels.py --warmup 5 --iters 20"),
        ("causality fp8 row compiled", 200, "python3 bench/causality_check.py --sizes 1b-bench "
                                            "--compile --fp8 row"),
        ("mega compile cudnn", 180, f"{_STEP} --size 1b-bench --mb 8 --compile "
                                    "--set train.attention_kernel=cudnn"),
        ("mega compile", 180, f"{_STEP} --size 1b-bench --mb 8 --compile"),
        ("profile moe-2b", 300, "python3 bench/kernel_profile.py --steps-run 8 --label moe-2b -- "
                                f"{_STEP.split(' ', 1)[1]} --size moe-2b --mb 4 --compile "
                                "--steps 5 --warmup 3"),
    ],
    # the sixth session's second look: the two-pass conv backward on the GPU (tests, kernels,
    # the hybrid step), steady-state profiles of 1b-bench bf16 and FP8 and of moe-2b
    # (accumulating 4 micro-batches a step), compiled row-wise FP8's first step against fp32
    "probe2": [
        ("mixer kernel tests", 300, "python3 -m pytest -q packages/models/tests/test_mixer_triton.py"),
        ("mixer kernels", 200, "python3 bench/mixer_kernels.py"),
        ("hybrid vs gpt", 400, "python3 bench/hybrid_vs_gpt.py --compile"),
        ("profile 1b-bench", 200, f"{_STEP} --size 1b-bench --mb 8 --compile --profile 3"),
        ("profile 1b-bench fp8", 200, f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --profile 3"),
        ("profile moe-2b accum 4", 240, f"{_STEP} --size moe-2b --mb 4 --accum 4 --compile "
                                        "--steps 8 --warmup 3 --profile 2"),
        ("fp8 grad check compiled row", 300, "python3 bench/fp8_grad_check.py --size 1b-bench "
                                             "--mb 2 --recipes row --compile"),
    ],
    # two GPUs (nvidia-h200-x2): data, tensor and pipeline parallel side by side
    "two-gpu": [
        ("dp 2", 240, f"{_TORCHRUN2} bench/mega_step.py --size 1b-bench --mb 8 --compile"),
        ("tp 2 + sp", 240, f"{_TORCHRUN2} bench/mega_step.py --size 1b-bench --mb 8 --tp 2 --sp --compile"),
        ("pp 2, 13/11", 240, f"{_TORCHRUN2} bench/mega_step.py --size 1b-bench --mb 8 --pp 2 --accum 8 "
                             "--pp-layers 13,11 --compile"),
    ],
}  # fmt: skip
SUITES["final8"] = [
    *[line for line in SUITES["target22"] if "accum" not in line[0]],
    ("hybrid old ssd", 150, "PYTHONPATH=.snap/ssd_old/packages/models/src:$PYTHONPATH "
                            "python3 bench/hybrid_vs_gpt.py --compile --only hybrid"),
    ("fp8 fixed scale", 110, "python3 bench/fp8_fixed_scale.py --size 1b-bench --mb 8 --compile "
                             "--fp8 --steps 10 --warmup 3"),
    *[line for line in SUITES["target22"] if "accum" in line[0]],
    ("fp8 row explain", 60, "python3 bench/fp8_row_probe.py --linear-only --explain "
                            "--backends aot_eager"),
    ("fp8 row clone", 60, "python3 bench/fp8_row_probe.py --linear-only --backends "
                          "aot_eager,inductor --same-dtype-alias clone"),
    ("deepseek-3b accum 8", 200, f"{_STEP} --size deepseek-3b --mb 4 --accum 8 --compile "
                                 "--steps 4 --warmup 2"),
]  # fmt: skip

# the same, cut to what ~400 s of device time holds, in the order of its worth
SUITES["final8b"] = [
    ("fp8 compile check", 120, "python3 bench/fp8_compile_check.py --scalings tensor,row,block"),
    ("mega compile fp8", 110, f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --steps 10 "
                              "--warmup 3"),
    ("fp8 fixed scale", 110, "python3 bench/fp8_fixed_scale.py --size 1b-bench --mb 8 --compile "
                             "--fp8 --steps 10 --warmup 3"),
    ("deepseek-3b accum 8", 200, f"{_STEP} --size deepseek-3b --mb 4 --accum 8 --compile "
                                 "--steps 4 --warmup 2"),
    ("mega compile", 110, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 10 --warmup 3"),
    ("hybrid vs gpt", 220, "python3 bench/hybrid_vs_gpt.py --compile"),
]  # fmt: skip

# what ~100 s of device time holds: the FP8 fix's proof on the GPU
SUITES["final8c"] = SUITES["final8b"][:1]

# the ninth session's first call: the FP8 fix's proof, then compiled row- and block-wise FP8
# beside tensor-wise and bf16, the fixed-scale bound, deepseek-3b at 8 micro-batches, the
# hybrid beside GPT (~570 s)
SUITES["s9a"] = [
    SUITES["final8b"][0],
    *[_fp8_recipe_step(recipe) for recipe in ("row", "tensor")],
    SUITES["final8b"][4],
    SUITES["final8b"][3],
    SUITES["final8b"][5],
    _fp8_recipe_step("block"),
    SUITES["final8b"][2],
]  # fmt: skip

# what ~300 s of device time holds (most of the ninth session's went to requests that found no
# machine): the FP8 fix's proof and compiled row-wise speed, targets 3 and 4 re-measured
SUITES["s9b"] = [SUITES["s9a"][i] for i in (0, 1, 4, 5)]

# the tenth session's call: issue 22's table in one call, deepseek-3b accumulating 8
# micro-batches (as training does) instead of 4, then the fixed-scale FP8 bound and a profile
# of compiled row-wise FP8 if the budget leaves room (~560 s)
SUITES["s10"] = [
    *[line for line in SUITES["target22"] if not line[0].startswith("deepseek")],
    SUITES["s9a"][4],
    SUITES["s9a"][7],
    ("profile fp8 row", 110,
     f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --set train.fp8_recipe=row --steps 4 "
     "--warmup 3 --profile 3"),
]  # fmt: skip

# the tenth session's second call: the experts' weight gradients straight into main_grad
# (mega_moe.wgrad_accum): the kernel's tests on the GPU, the kernel alone against grouped_mm
# plus the accumulation, then deepseek-3b at 8 micro-batches with and without it (~520 s)
_DEEPSEEK8 = f"{_STEP} --size deepseek-3b --mb 4 --accum 8 --compile --steps 4 --warmup 2"
SUITES["s10b"] = [
    ("wgrad kernel tests", 200, "python3 -m pytest -q -rs "
                                "packages/moe/tests/test_wgrad_into_main_grad.py -k 'triton or cuda'"),
    ("expert wgrad", 120, "python3 bench/expert_wgrad.py"),
    ("deepseek-3b accum 8 fused", 170, _DEEPSEEK8),
    ("deepseek-3b accum 8 unfused", 170,
     f"{_DEEPSEEK8} --set parallel.wgrad_into_main_grad=false --tag unfused"),
    ("moe-2b accum 4 fused", 150, f"{_STEP} --size moe-2b --mb 4 --accum 4 --compile "
                                  "--steps 6 --warmup 2"),
    SUITES["s10"][-2],
    SUITES["s10"][-1],
]  # fmt: skip

# the tenth session's third call: s10b's wgrad lines again after the op stopped taking the
# main gradient as a graph input (Inductor summed aliased inputs mutated in backward wrongly
# and the autotuner's copy of one failed), then the hybrid beside GPT once more (~450 s)
SUITES["s10c"] = [
    SUITES["s10b"][0],
    *SUITES["s10b"][2:5],
    SUITES["target22"][8],
]  # fmt: skip

# issue 22's table for the next call, in one call under the 600 s limit (~590 s): target22
# without block-wise FP8 (805 ms a step on an H100; s10 overran with it) and with the MoE
# lines, deepseek-3b at 8 micro-batches as training accumulates, before the hybrid
SUITES["target22b"] = [
    *[line for line in SUITES["target22"][:8] if "block" not in line[0]],
    SUITES["target22"][9],
    ("deepseek-3b accum 8", 170, _DEEPSEEK8),
    SUITES["target22"][8],
]  # fmt: skip

# the eleventh session's first call: delayed FP8 scaling (train.fp8_amax_history) beside
# current scaling and bf16, compiled 1b-bench on one GPU; deepseek-3b at 8 micro-batches with
# and without the fused expert weight gradients; a profile of the delayed step (~570 s)
_DELAYED = f"{_STEP} --size 1b-bench --mb 8 --compile --fp8 --set train.fp8_amax_history=16"
SUITES["s11"] = [
    SUITES["target22"][1],
    SUITES["target22"][2],
    ("mega compile fp8 delayed", 170, f"{_DELAYED} --steps 10 --warmup 4"),
    SUITES["s10b"][2],
    ("profile fp8 delayed", 130, f"{_DELAYED} --steps 4 --warmup 4 --profile 3"),
    SUITES["s10b"][3],
]  # fmt: skip

# delayed FP8's loss over 200 steps beside bf16's own spread (two bf16 runs that differ only
# in the micro-batch split, so in summation order) and current-scaling FP8: the trainer on
# 1b-bench, global batch 8, every step logged; bench/compare_runs.py prints the table (~560 s)
_LOSS = (
    "python3 -m mega_pretrain --model.size 1b-bench --train.seq_len 2048 --train.steps 200 "
    "--train.global_batch_size 8 --train.compile true --train.log_interval 1 "
    "--train.eval_interval 0 --checkpoint.save_interval 0 --run.out_dir /tmp/runs"
)


def _loss_run(name: str, flags: str, base: str = _LOSS) -> str:
    """The run, then its end-of-run checkpoint removed (~14 GB each at 1b-bench)."""
    return f"{base} {flags} --run.name {name}; rc=$?; rm -rf /tmp/runs/{name}/checkpoints; exit $rc"


SUITES["fp8loss"] = [
    ("loss bf16", 150, _loss_run("l-bf16", "--train.micro_batch_size 8")),
    ("loss bf16 mb4", 150, _loss_run("l-bf16-mb4", "--train.micro_batch_size 4")),
    ("loss fp8 delayed", 150, _loss_run("l-fp8d", "--train.micro_batch_size 8 --train.fp8 true "
                                                  "--train.fp8_amax_history 16")),
    ("loss fp8", 150, _loss_run("l-fp8", "--train.micro_batch_size 8 --train.fp8 true")),
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/l-bf16 /tmp/runs/l-bf16-mb4 "
                    "/tmp/runs/l-fp8d /tmp/runs/l-fp8"),
]  # fmt: skip

# the eleventh session's call once the device budget was down to one call: delayed FP8's
# speed beside bf16 and its 200-step loss beside bf16's, current scaling last (~560 s)
SUITES["s11a"] = [
    SUITES["s11"][0],
    SUITES["s11"][2],
    SUITES["fp8loss"][2],
    SUITES["fp8loss"][0],
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/l-bf16 /tmp/runs/l-fp8d"),
    SUITES["s11"][1],
]  # fmt: skip

# why delayed FP8 ran no faster than current scaling (s11a: 1.172x vs 1.202x bf16): every
# kernel of both steps profiled, and delayed with its amax recording switched off in parts,
# beside the fixed-scale bound (~250 s)
_FP8 = "--size 1b-bench --mb 8 --compile --fp8"
SUITES["s11b"] = [
    ("profile fp8 delayed", 100, f"{_DELAYED} --steps 4 --warmup 4 --profile 3"),
    ("profile fp8", 100, f"{_STEP} {_FP8} --steps 4 --warmup 3 --profile 3"),
    ("delayed no-record", 90, f"python3 bench/fp8_delayed_parts.py --part no-record {_FP8} "
                              "--set train.fp8_amax_history=16 --steps 10 --warmup 4"),
    ("delayed no-probe", 90, f"python3 bench/fp8_delayed_parts.py --part no-probe {_FP8} "
                             "--set train.fp8_amax_history=16 --steps 10 --warmup 4"),
    ("fixed-scale bound", 90, f"python3 bench/fp8_fixed_scale.py {_FP8} --steps 10 --warmup 3"),
]  # fmt: skip

# the fixed-scale bound beside the dynamic step on one machine (the tenth session compared
# them across two H100s); ~80 s
SUITES["s11c"] = [
    SUITES["s11b"][4],
    ("mega compile fp8", 90, f"{_STEP} {_FP8} --steps 10 --warmup 3"),
]  # fmt: skip

# amaxes reduced over rows first (recorded_amax), so they can fuse into the producing kernels:
# current scaling as landed (whole-tensor amax) and rows-first, delayed (rows-first), in one
# call (~130 s)
SUITES["s11d"] = [
    ("fp8 whole-tensor amax", 60, f"{_STEP} {_FP8} --steps 6 --warmup 3"),
    ("fp8 rows-first amax", 60, f"python3 bench/fp8_delayed_parts.py --part rows-amax {_FP8} "
                                "--steps 6 --warmup 3"),
    ("fp8 delayed rows-first", 70, f"{_DELAYED} --steps 6 --warmup 4"),
]  # fmt: skip

# what the eleventh session owes, one GPU, in order of value (~560 s): the rows-first A/B and
# delayed after its bookkeeping change (s11d), the fixed-scale bound beside current scaling on
# one machine, a profile of delayed, and deepseek-3b with the fused expert gradients
SUITES["owed11"] = [
    ("mega compile bf16", 60, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 6 --warmup 3"),
    *SUITES["s11d"],
    SUITES["s11b"][4],
    SUITES["s11"][3],
    SUITES["s11b"][0],
]  # fmt: skip
# fp8 weights cached across micro-batches (train.fp8_weight_cache): 1b-bench at mb 1 x 8
# micro-batches a step, bf16 / fp8 / fp8 cached, and mb 8 x 1 cached (nothing to reuse: the
# cost of the cache's write) (~300 s); then the expert GEMMs in fp8 (torch._scaled_grouped_mm)
# against bf16 at the MoE sizes' shapes, before an fp8 expert FFN is built (~60 s)
_ACC = "--size 1b-bench --mb 1 --accum 8 --compile --steps 5 --warmup 3"
SUITES["s12"] = [
    ("bf16 mb1 x8", 70, f"{_STEP} {_ACC}"),
    ("fp8 mb1 x8", 70, f"{_STEP} {_ACC} --fp8"),
    ("fp8 cached mb1 x8", 70, f"{_STEP} {_ACC} --fp8 --set train.fp8_weight_cache=true"),
    ("fp8 cached mb8", 70, f"{_STEP} {_FP8} --steps 6 --warmup 3 "
                           "--set train.fp8_weight_cache=true"),
    ("fp8 grouped probe", 90, "python3 bench/fp8_grouped_probe.py"),
]  # fmt: skip

# is delayed scaling's loss gap (8 % early at 1b-bench) saturation? bf16, delayed (history
# 16) whose log carries each step's amax overshoot, delayed with a margin of 1 (2x
# headroom), and recording one step in 8 with that margin, 200 trainer steps each, then the
# overshoot column of every step (~570 s)
_DELAYED_LOSS = "--train.micro_batch_size 8 --train.fp8 true --train.fp8_amax_history 16"
SUITES["s12c"] = [
    ("loss bf16", 140, _loss_run("l-bf16", "--train.micro_batch_size 8")),
    ("loss fp8 delayed", 140, _loss_run("l-fp8d", _DELAYED_LOSS)),
    ("loss fp8 delayed margin 1", 140, _loss_run("l-fp8dm1", f"{_DELAYED_LOSS} "
                                                            "--train.fp8_amax_margin 1")),
    ("loss fp8 delayed interval 8 margin 1", 140, _loss_run(
        "l-fp8di8", f"{_DELAYED_LOSS} --train.fp8_amax_margin 1 --train.fp8_amax_interval 8")),
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/l-bf16 /tmp/runs/l-fp8d "
                    "/tmp/runs/l-fp8dm1 /tmp/runs/l-fp8di8; for r in l-fp8d l-fp8dm1; do python3 -c \"import json,"
                    "sys; rs=[json.loads(l) for l in open(sys.argv[1])]; "
                    "print(sys.argv[1], [(r['step'], round(r['fp8_overshoot_input'], 2), "
                    "round(r['fp8_overshoot_grad'], 2)) for r in rs if r.get('kind') == 'train'"
                    "][:40])\" /tmp/runs/$r/metrics.jsonl; done"),
]  # fmt: skip

# delayed scaling recording in the fusable rows-first form (recorded_amax, the default; it
# was the opaque reduction from 2026-12-06 until owed12 measured that 3 % slower on
# 2026-12-07) against the opaque reduction (opaque_amax), and current scaling's amax the
# same two ways, beside bf16 in one call (~200 s)
_PARTS = "python3 bench/fp8_delayed_parts.py"
SUITES["s12b"] = [
    ("mega compile bf16", 60, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 6 --warmup 3"),
    ("fp8 current", 60, f"{_STEP} {_FP8} --steps 6 --warmup 3"),
    ("fp8 delayed", 70, f"{_DELAYED} --steps 6 --warmup 4"),
    ("fp8 delayed opaque record", 70, f"{_PARTS} --part opaque-record {_FP8} "
                                     "--set train.fp8_amax_history=16 --steps 6 --warmup 4"),
    ("fp8 current opaque amax", 60, f"{_PARTS} --part opaque-amax {_FP8} --steps 6 --warmup 3"),
]  # fmt: skip

# what the twelfth session owes, one GPU, in order of value (each line's limit is generous:
# they ran ~35 s each in s12): the opaque recording's A/B (s12b) with the recording interval,
# the weight cache with its transposed copy at mb 1 x 8 and its GPU check; then the loss
# question (s12c, its own call)
SUITES["owed12"] = [
    *SUITES["s12b"][:3],
    # one step in 8 records amaxes: the median step is a non-recording one (the bound's
    # speed if it holds), the max a recording one; 8 warm-up steps compile both variants
    ("fp8 delayed interval 8", 90, f"{_DELAYED} --set train.fp8_amax_interval=8 --steps 16 "
                                   "--warmup 8"),
    *SUITES["s12b"][3:],
    SUITES["s12"][1],
    SUITES["s12"][2],
    ("fp8 cache check", 120, "python3 bench/fp8_cache_check.py --mb 1 --accum 4 --steps 4"),
]  # fmt: skip

# the 1-step history's loss beside bf16 at 1b-bench (~260 s; the 16-step one is s11a's)
SUITES["fp8loss1"] = [
    SUITES["fp8loss"][0],
    ("loss fp8 delayed 1", 150, _loss_run("l-fp8d1", "--train.micro_batch_size 8 --train.fp8 true "
                                                     "--train.fp8_amax_history 1")),
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/l-bf16 /tmp/runs/l-fp8d1"),
]  # fmt: skip

# target 1's untried lever: Inductor's max-autotune (Triton GEMM templates benchmarked
# against cuBLAS, pointwise epilogues - SwiGLU, residual adds - fused into a template that
# wins), bf16 1b-bench beside the default mode in one call; then target 3 on the H200
# (deepseek-3b, 8 micro-batches a step, fused expert gradients) (~450 s)
_BF16 = f"{_STEP} --size 1b-bench --mb 8 --compile --steps 6 --warmup 3"
SUITES["s13"] = [
    ("mega compile bf16", 60, _BF16),
    # every kernel of the bf16 step into $OUT: what the 9.9 ms of copies are
    ("profile bf16", 90, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 4 --warmup 3 --profile 3"),
    ("mega compile bf16 max-autotune", 330,
     f"{_BF16} --set train.compile_mode=max-autotune-no-cudagraphs --tag autotune"),
    ("deepseek-3b accum 8", 170, _DEEPSEEK8),
]  # fmt: skip

# target 3 on the H200, then target 2's numerics in the same call, trimmed to fit one call:
# bf16, delayed (history 16, the overshoot logged) and the fast candidate (recording one
# step in 8, margin 1), 200 trainer steps each, compared (~590 s)
SUITES["s13b"] = [
    ("deepseek-3b accum 8", 170, _DEEPSEEK8),
    SUITES["s12c"][0],
    SUITES["s12c"][3],
    SUITES["s12c"][1],
    ("compare", 20, SUITES["s12c"][4][2].replace(" /tmp/runs/l-fp8dm1 ", " ")
     .replace("for r in l-fp8d l-fp8dm1;", "for r in l-fp8d l-fp8di8;")),
]  # fmt: skip

# what the thirteenth session owes, one GPU (~520 s): the flat AdamW kernel beside torch's,
# the transposed fp8 copies made by a
# tiled kernel the compiler cannot fuse (fp8_delayed_parts --part opaque-transpose) against
# Inductor's fused transposed stores, under delayed scaling with the recording interval
# (the fastest FP8 so far) and under current scaling, beside bf16; then Inductor's generated
# code of the delayed step, gzipped into $OUT, to read what each slow kernel computes
_INTERVAL8 = f"{_DELAYED} --set train.fp8_amax_interval=8 --steps 16 --warmup 8"
SUITES["owed13"] = [
    # the two new Triton kernels against their torch references, on the GPU first
    ("new kernel tests", 60, "python3 -m pytest -q -p no:cacheprovider "
                             "packages/zero-optim/tests/test_flat_adamw.py::test_triton_kernel_equals_torch_ops "
                             "packages/tp-layers/tests/test_fp8_transpose.py::test_triton_kernel"),
    ("mega compile bf16", 60, _BF16),
    # AdamW and the bf16 write-back in one flat Triton kernel per shard run (predicted ~-6 ms)
    ("mega compile bf16 flat optimizer", 60, f"{_BF16} --set train.optimizer_kernel=flat"),
    ("fp8 delayed interval 8", 90, _INTERVAL8),
    ("fp8 delayed interval 8 opaque transpose", 100,
     f"{_PARTS} --part opaque-transpose {_FP8} --set train.fp8_amax_history=16 "
     "--set train.fp8_amax_interval=8 --steps 16 --warmup 8"),
    ("fp8 current", 60, f"{_STEP} {_FP8} --steps 6 --warmup 3"),
    ("fp8 current opaque transpose", 70,
     f"{_PARTS} --part opaque-transpose {_FP8} --steps 6 --warmup 3"),
    ("fp8 output code", 120,
     f"TORCH_LOGS=output_code {_DELAYED} --set train.fp8_amax_interval=8 --steps 2 --warmup 2 "
     "2>&1 | gzip > $OUT/fp8_output_code.log.gz; ls -la $OUT/fp8_output_code.log.gz"),
]  # fmt: skip

# delayed scaling's loss with a margin of 2 (covers the 4x gradient growth s12c's log showed)
# and the recording interval, beside bf16, 200 trainer steps each (~300 s)
SUITES["s13c"] = [
    SUITES["s12c"][0],
    ("loss fp8 delayed interval 8 margin 2", 140, _loss_run(
        "l-fp8di8m2", f"{_DELAYED_LOSS} --train.fp8_amax_margin 2 --train.fp8_amax_interval 8")),
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/l-bf16 /tmp/runs/l-fp8di8m2"),
]  # fmt: skip

# target 3: deepseek-3b at 8 micro-batches, then its profile (kernel time against step time:
# whether the 29.6 % of two H100s that ran the dense step at the usual speed is the host's
# launch rate, as their slow mb 1 x 8 FP8 lines suggest) (~330 s)
SUITES["s13d"] = [
    ("deepseek-3b accum 8", 170, _DEEPSEEK8),
    ("profile deepseek-3b accum 8", 170, f"{_DEEPSEEK8} --profile 1"),
]  # fmt: skip

# the fourteenth session's first call (~540 s): the new kernels' tests and the MoE key fix's
# CUDA test on the GPU; deepseek-3b with its MoE layers all compiled again (the int key had
# left the last 4 of 11 uncompiled past dynamo's recompile limit; predicted >= 34.5 % on an
# H100 like the eleventh session's, ~36 % with the fused expert gradients); bf16 with and
# without the flat optimizer; delayed interval 8 with and without the opaque transposes
SUITES["s14a"] = [
    ("new kernel tests", 90, "python3 -m pytest -q -p no:cacheprovider "
                             "packages/zero-optim/tests/test_flat_adamw.py::test_triton_kernel_equals_torch_ops "
                             "packages/tp-layers/tests/test_fp8_transpose.py::test_triton_kernel "
                             "packages/moe/tests/test_wgrad_into_main_grad.py -k 'cuda or share'"),
    ("deepseek-3b accum 8", 170, _DEEPSEEK8),
    *SUITES["owed13"][1:5],
]  # fmt: skip

# the second call (~330 s): current scaling with and without the opaque transposes, the FP8
# output code, moe-2b (12 MoE layers: its last 4 ran uncompiled too; predicted ~1.1x the
# 32-38 % it ran at)
SUITES["s14b"] = [
    *SUITES["owed13"][5:],
    ("moe-2b accum 4", 120, f"{_STEP} --size moe-2b --mb 4 --accum 4 --compile --steps 4 --warmup 2"),
    # the DeepSeek-V3-shaped size (MLA, MTP) at deepseek-3b's tokens a step: its only line
    # (25.0 % at mb 4 x 1, 2026-12-01) amortised the optimizer over one micro-batch; mb 2
    # because mb 4 peaked at 77 GiB on an H200 (predicted ~30-33 %, below deepseek-3b's)
    ("deepseek-v3-3b accum 16", 160,
     f"{_STEP} --size deepseek-v3-3b --mb 2 --accum 16 --compile --steps 3 --warmup 2"),
]  # fmt: skip

# s14a cut to what the scarce device time allows (~380 s): the GPU tests, deepseek-3b, and
# bf16 with and without the flat optimizer
SUITES["s14short"] = SUITES["s14a"][:4]

# the same, deepseek-3b first (the device budget down to one short call)
SUITES["s14min"] = [SUITES["s14a"][1], SUITES["s14a"][0], *SUITES["s14a"][2:4]]

# fifteenth session, one call (~580 s): s14short, then target 1's eager line with the
# activation and RoPE as compiled regions (model.fused_elementwise; predicted ~-10 ms of
# ~334: mega eager 1.02x -> ~1.05x plain eager) beside mega eager and plain eager
_EAGER = f"{_STEP} --size 1b-bench --mb 8 --steps 5 --warmup 2"
SUITES["s15"] = [
    *SUITES["s14short"],
    ("mega eager fused elementwise", 80, f"{_EAGER} --set model.fused_elementwise=true"),
    ("mega eager", 60, _EAGER),
    ("torch eager", 60, f"{_TORCH} --mb 8 --steps 5 --warmup 2"),
]

# sixteenth session, one call (~560 s): issue 22's target 1 side by side with the CUDA
# defaults as they now stand (train.optimizer_kernel auto -> flat, model.fused_elementwise
# None -> fused in eager; predicted compiled ~1.02-1.03x plain bf16 compiled, eager ~1.3x
# plain eager), the torch 2.11 check of the MoE layers' one shared graph, and the profile
# of the DeepSeek-V3-shaped size (28.7 % MFU): where its time goes
_BF16_10 = f"{_STEP} --size 1b-bench --mb 8 --compile --steps 10 --warmup 3"
SUITES["s16"] = [
    ("ceiling", 60, _CEILING),
    ("mega compile", 90, _BF16_10),
    ("torch bf16 compile", 90, f"{_TORCH} --mb 8 --compile --precision bf16 --steps 10 --warmup 3"),
    ("profile deepseek-v3-3b accum 16", 170,
     f"{_STEP} --size deepseek-v3-3b --mb 2 --accum 16 --compile --steps 3 --warmup 2 --profile 1"),
    ("share test", 60, "python3 -m pytest -q -p no:cacheprovider "
                       "packages/moe/tests/test_wgrad_into_main_grad.py -k share"),
    ("mega eager", 60, _EAGER),
    ("torch eager", 60, f"{_TORCH} --mb 8 --steps 5 --warmup 2"),
    ("torch liger eager", 70, SUITES["target22"][7][2].replace("--steps 10 --warmup 3",
                                                                "--steps 5 --warmup 2")),
    ("torch compile", 90, f"{_TORCH} --mb 8 --compile --steps 10 --warmup 3"),
]  # fmt: skip

# the second call: MLA's core attention alone at deepseek-v3-3b's shape (qk 192, v 128) with
# the values zero-padded for FlashAttention-2 (as latent_sdpa does) against cuDNN and the
# efficient kernel on the unequal dims (predicted: cuDNN unpadded <= 0.85x the padded
# flash's fwd+bwd time, which does 1.2x the FLOPs); deepseek-v3-3b at mb 4 x 8 with the
# allocator's expandable segments (mb 4 peaked at 77 GiB on an H200, mb 2 at 69.5 GiB on an
# H100; predicted ~31-33 % if it fits)
_MLA = "python3 bench/attn_kernels.py --heads 16 --head-dim 192 --v-head-dim 128"
SUITES["s16b"] = [
    ("mla attention mb 2", 60, f"{_MLA} --batch 2 --kernels flash-pad,cudnn,efficient"),
    ("mla attention mb 4", 60, f"{_MLA} --batch 4 --kernels flash-pad,cudnn"),
    ("deepseek-v3-3b mb 4 accum 8", 200,
     f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True {_STEP} --size deepseek-v3-3b --mb 4 "
     "--accum 8 --compile --steps 3 --warmup 2"),
    # every kernel of the bf16 step with the CUDA defaults (flat optimizer): what is left of
    # the 9.9 ms of copies and 12.9 ms of optimizer the thirteenth session's profile showed
    ("profile bf16", 100, f"{_STEP} --size 1b-bench --mb 8 --compile --steps 4 --warmup 3 "
                          "--profile 3"),
]  # fmt: skip

# the third call: the GPU tests of this session's CUDA changes (MLA on cuDNN's narrow-value
# kernel, the flat AdamW kernel with bf16 moments, the torch 2.11 shape-function check),
# then target 3 at the DeepSeek-V3-shaped size, mb 4 x 8 (34.0 % in s16b, padded values):
# with cuDNN on the unequal dims (predicted ~-20 ms, ~34.7 %), with bf16 moments as well
# (predicted ~-10 ms more, ~35 %), and the padded A/B; then 1b-bench with bf16 moments
# (predicted -2 … -3 ms of the optimizer's ~12)
_DSV3_MB4 = (
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True {} --size deepseek-v3-3b --mb 4 "
    "--accum 8 --compile --steps 3 --warmup 2"
)
SUITES["s16c"] = [
    ("gpu tests", 120, "python3 -c 'import torch; print(\"cudnn\", torch.backends.cudnn.version())' && "
                       "python3 -m pytest -q -p no:cacheprovider "
                       "packages/models/tests/test_mla.py packages/zero-optim/tests/test_flat_adamw.py "
                       "packages/moe/tests/test_wgrad_into_main_grad.py "
                       "-k 'cuda or cudnn or share or triton_kernel_equals'"),
    ("mla attention mb 4 cudnn", 50, f"{_MLA} --batch 4 --kernels cudnn-pad,cudnn"),
    ("deepseek-v3-3b mb 4 bf16 moments", 110,
     _DSV3_MB4.format(_STEP) + " --set train.optimizer_moment_dtype=bf16"),
    ("deepseek-v3-3b mb 4", 100, _DSV3_MB4.format(_STEP)),
    ("deepseek-v3-3b mb 4 padded", 100, _DSV3_MB4.format("python3 bench/mla_padded.py")),
    ("1b-bench bf16 moments", 70, f"{_BF16_10} --set train.optimizer_moment_dtype=bf16"),
]  # fmt: skip

# what the sixteenth session owes, one GPU, two calls (~560 s and ~520 s). s17a: the MLA
# narrow-value check in its rewritten form (c22016a) on the GPU, then target 3's size with it
# beside the padded path (1.04x in s16c), and bf16 moments at 8 timed steps each (the
# optimizer's share beyond 3 steps' noise: -5 … -10 ms predicted)
_DSV3_8 = _DSV3_MB4.replace("--steps 3", "--steps 8")
SUITES["s17a"] = [
    ("mla gpu tests", 60, "python3 -m pytest -q -p no:cacheprovider packages/models/tests/test_mla.py "
                          "-k 'cudnn or padded_on_cuda'"),
    ("deepseek-v3-3b mb 4", 130, _DSV3_8.format(_STEP)),
    ("deepseek-v3-3b mb 4 bf16 moments", 140,
     _DSV3_8.format(_STEP) + " --set train.optimizer_moment_dtype=bf16"),
    ("deepseek-v3-3b mb 4 padded", 130, _DSV3_8.format("python3 bench/mla_padded.py")),
]  # fmt: skip

# s17b: 1b-bench with and without bf16 moments (-2 … -3 ms predicted), and delayed FP8
# recording one step in 8 with and without the opaque fp8 transposes (-4 … -6 ms predicted:
# the SwiGLU backward's bf16 gradient then has one consumer, see NOTES 2026-12-07 sixteenth)
SUITES["s17b"] = [
    ("mega compile bf16", 80, _BF16_10),
    ("mega compile bf16 bf16 moments", 80, f"{_BF16_10} --set train.optimizer_moment_dtype=bf16"),
    SUITES["owed13"][3],
    SUITES["owed13"][4],
]  # fmt: skip

# the seventeenth session: the FP8 expert FFN (model.moe_expert_fp8, issue 22's "the expert
# FFN in FP8 as an option"). s17c: its GPU tests (torch._scaled_grouped_mm against the
# emulation, eager and compiled) with the owed MLA cuDNN test, then deepseek-v3-3b mb 4 x 8
# (bf16 moments: room for the 2 bytes a parameter of cached fp8 expert weights) with and
# without it. Prediction: -15 … -35 ms of ~925 (the probe's fwd+dgrad 1.21-1.56x on
# ~173 ms of expert GEMMs, less the row quantisation and the padded layout's copies)
_DSV3_5 = _DSV3_MB4.replace("--steps 3", "--steps 5") + " --set train.optimizer_moment_dtype=bf16"
SUITES["s17c"] = [
    ("fp8 expert + mla gpu tests", 120, "python3 -m pytest -q -p no:cacheprovider "
                                        "packages/moe/tests/test_fp8_experts.py "
                                        "packages/models/tests/test_mla.py "
                                        "-k 'cuda or cudnn or padded_on_cuda'"),
    ("deepseek-v3-3b mb 4 bf16 moments", 150, _DSV3_5.format(_STEP)),
    ("deepseek-v3-3b mb 4 bf16 moments fp8 experts", 170,
     _DSV3_5.format(_STEP) + " --set model.moe_expert_fp8=true"),
]  # fmt: skip

# s17d: the FP8 experts' loss beside bf16's and bf16's own spread (another micro-batch size,
# the same global batch), deepseek-3b, 100 steps; prediction: within the spread after ~20 steps
_MOE_LOSS = (
    "python3 -m mega_pretrain --model.size deepseek-3b --train.seq_len 2048 --train.steps 100 "
    "--train.global_batch_size 8 --train.compile true --train.log_interval 1 "
    "--train.eval_interval 0 --checkpoint.save_interval 0 --run.out_dir /tmp/runs"
)


def _moe_loss_run(name: str, flags: str) -> str:
    return _loss_run(name, flags, _MOE_LOSS)


# what the seventeenth session owes (one GPU, one call, ~560 s): the FP8 experts' GPU tests
# (and the row kernel's, bitwise against torch), then deepseek-v3-3b without and with them
# after the coalesced transposed weight quantisation (-20 ms predicted: 26 ms of transposed
# quantisation a step), with the one-pass row kernel swapped in (-45 ms more), and the
# bf16 step's profile (its grouped-GEMM time beside the fp8 profile's 103.8 ms)
SUITES["s18a"] = [
    ("fp8 expert gpu tests", 120, "python3 -m pytest -q -p no:cacheprovider "
                                  "packages/moe/tests/test_fp8_experts.py "
                                  "packages/moe/tests/test_fp8_rows.py -k 'cuda or row_kernel'"),
    SUITES["s17c"][1],
    SUITES["s17c"][2],
    ("deepseek-v3-3b mb 4 bf16 moments fp8 experts row kernel", 150,
     _DSV3_5.format("python3 bench/fp8_expert_parts.py --part row-kernel")
     + " --set model.moe_expert_fp8=true"),
    ("profile deepseek-v3-3b bf16 moments", 150,
     _DSV3_5.format(_STEP).replace("--steps 5 --warmup 2", "--steps 2 --warmup 2 --profile 1")),
]  # fmt: skip

# s17e: s17d cut to what one call after s17c can hold (80 steps, no spread run)
SUITES["s17e"] = [
    ("moe loss bf16 mb4", 130, _moe_loss_run("m-bf16", "--train.micro_batch_size 4 --train.steps 80")),
    ("moe loss fp8 experts mb4", 130, _moe_loss_run("m-fp8e", "--train.micro_batch_size 4 "
                                                              "--train.steps 80 "
                                                              "--model.moe_expert_fp8 true")),
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/m-bf16 /tmp/runs/m-fp8e"),
]  # fmt: skip

SUITES["s17d"] = [
    ("moe loss bf16 mb4", 150, _moe_loss_run("m-bf16", "--train.micro_batch_size 4")),
    ("moe loss fp8 experts mb4", 150, _moe_loss_run("m-fp8e", "--train.micro_batch_size 4 "
                                                              "--model.moe_expert_fp8 true")),
    ("moe loss bf16 mb2", 150, _moe_loss_run("m-bf16-mb2", "--train.micro_batch_size 2")),
    ("compare", 20, "python3 bench/compare_runs.py /tmp/runs/m-bf16 /tmp/runs/m-bf16-mb2 "
                    "/tmp/runs/m-fp8e"),
]  # fmt: skip

# the eighteenth session, one H200, in the order of its worth (one call, ~560 s): the GPU
# tests of the code not yet run there (the dense linears' gradient-accumulation fusion,
# mega_tp_layers.main_grad_fusion; the fp8 experts after review; the one-pass row kernel,
# bitwise against torch); then issue 22's closing table: the ceiling; target 1 (mega
# compiled bf16, the fusion on by default, beside the plain-PyTorch reference with the same
# precision scheme) and the fusion's A/B (predicted -1 ... -3 ms of ~270: the s16 profile's
# 2.9 ms _accumulate_kernel); target 2 (the fastest FP8: delayed scaling recording one step
# in 8, margin 2, as its loss was run); target 4 (the hybrid beside GPT); target 3 at the
# DeepSeek-V3-shaped size with bf16 moments. Eager and Liger stand as measured in s16.
SUITES["s18b"] = [
    ("gpu tests", 180, "python3 -m pytest -q -p no:cacheprovider "
                       "packages/tp-layers/tests/test_main_grad_fusion.py "
                       "packages/moe/tests/test_fp8_experts.py packages/moe/tests/test_fp8_rows.py "
                       "-k 'cuda or row_kernel'"),
    ("ceiling", 50, _CEILING),
    ("mega compile", 80, _BF16_10),
    ("torch bf16 compile", 80, f"{_TORCH} --mb 8 --compile --precision bf16 --steps 10 --warmup 3"),
    ("mega compile no wgrad fusion", 80, f"{_BF16_10} --set parallel.wgrad_into_main_grad=false"),
    ("mega compile fp8 delayed i8 m2", 90, f"{_INTERVAL8} --set train.fp8_amax_margin=2"),
    ("hybrid vs gpt", 160, "python3 bench/hybrid_vs_gpt.py --compile"),
    ("deepseek-v3-3b mb 4 bf16 moments", 130, _DSV3_MB4.format(_STEP)
     + " --set train.optimizer_moment_dtype=bf16"),
]  # fmt: skip

# s18c: what s18a measured of the fp8 experts, after s18b: deepseek-v3-3b with them after the
# coalesced transposed weight quantisation (-20 ms predicted against s17c's 904.0 ms), with
# the one-pass row kernel swapped in (-45 ms more; adopt as the default if faster), and the
# bf16 step's profile (its grouped-GEMM time beside the fp8 profile's 103.8 ms)
SUITES["s18c"] = [
    SUITES["s18a"][1],
    SUITES["s18a"][2],
    SUITES["s18a"][3],
    SUITES["s18a"][4],
]

# s20c, after s20a (or fa4a): the experts' weight-gradient kernel timed alone again (its JSON
# must be in this call's $OUT), then deepseek-v3-3b mb 4 x 8 (bf16 moments) with the fastest
# configuration it timed (bench/wgrad_blocks.py --blocks best) beside the default blocks
# (prediction: -25 … -40 ms if a prefetching one wins as predicted), then the hybrid beside
# GPT (owed on an H200 since the Triton scan)
SUITES["s20c"] = [
    ("expert wgrad", 150, "python3 bench/expert_wgrad.py"),
    ("deepseek-v3-3b mb 4 bf16 moments", 130, _DSV3_5.format(_STEP)),
    ("deepseek-v3-3b mb 4 bf16 moments wgrad best", 130,
     _DSV3_5.format("python3 bench/wgrad_blocks.py --blocks best")),
    ("hybrid vs gpt", 160, "python3 bench/hybrid_vs_gpt.py --compile"),
]  # fmt: skip

# FlashAttention-4 behind SDPA (train.attention_kernel fa4; issue 22, target 1's attention),
# two calls on one warm machine: its wheels (bench/fa4_wheels.sh) are larger than one call's
# carry. fa4a carries .snap/head/.fa4/a and keeps its part in the checkout's ignored
# .fa4keep there, then runs the new MoE code's GPU tests, times the wgrad kernel's
# configurations and takes the routing A/B at deepseek-v3-3b; fa4b carries .snap/head/.fa4/b, unpacks both halves into /tmp/fa4site and
# measures with fa4 beside its own baselines. Prediction (nineteenth session): at
# FA3's ~600 TFLOP/s forward, ~-9 ms of the 268 ms step (~1.035x). fa4a also times the
# experts' weight-gradient kernel with the main gradient's tile read before the products
# (PREFETCH, twentieth session): prediction fc1 ~1.0 -> ~0.65 ms, fc2 ~0.5 -> ~0.33 ms.
_FA4_SITE = "/tmp/fa4site"
_FA4 = f"PYTHONPATH={_FA4_SITE}:{_FA4_SITE}/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
SUITES["fa4a"] = [
    ("keep part 00", 20, "mkdir -p ../../.fa4keep && cp .fa4/a/cu13.tar.xz.part00 ../../.fa4keep/"),
    (
        "wgrad kernel and routing gpu tests",
        90,
        "python3 -m pytest -q -p no:cacheprovider "
        "packages/moe/tests/test_wgrad_into_main_grad.py packages/moe/tests/test_routing_order.py "
        "-k 'triton_kernel or cuda'",
    ),
    *SUITES["s20c"][:2],
    # the routing without sorts (the default) against the sorts it replaced
    # (bench/routing_parts.py; prediction: -15 … -25 ms of the ~30 ms of gatherTopK and sorts)
    (
        "deepseek-v3-3b mb 4 bf16 moments routing sorts",
        130,
        _DSV3_5.format("python3 bench/routing_parts.py --part sorts"),
    ),
]
# s20a: fa4a without its FA4 part, for device time that fits one call, not FA4's two
SUITES["s20a"] = SUITES["fa4a"][1:]
SUITES["fa4b"] = [
    ("unpack fa4", 90, f"python3 bench/fa4_unpack.py {_FA4_SITE} ../../.fa4keep .fa4/b"),
    ("attn kernels fa4", 200, f"{_FA4} python3 bench/attn_kernels.py --kernels cudnn,fa4"),
    ("mega compile fa4", 150, f"{_FA4} {_BF16_10} --set train.attention_kernel=fa4"),
    ("mega compile", 80, _BF16_10),
]


_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONWARNINGS": "ignore",
}


def _env(out: Path) -> dict[str, str]:
    env = dict(os.environ, OUT=str(out), **_ENV)
    paths = sorted(str(p) for p in (*ROOT.glob("packages/*/src"), *ROOT.glob("apps/*/src")))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_suite(name: str, out: Path, env: dict[str, str], deadline: float) -> list[str]:
    """Run every command of suite ``name`` that can start before ``deadline`` (perf_counter
    seconds), each cut at its own timeout or the deadline; one status line per command."""
    status = []
    log = out / f"{name}.log"
    for label, own_timeout, command in SUITES[name]:
        start = time.perf_counter()
        timeout = int(min(own_timeout, deadline - start))
        if timeout < 20:
            status.append(f"{name:>9} | {label:<26} | not run: the --budget was spent")
            print(status[-1], flush=True)
            continue
        with log.open("a") as f:
            f.write(f"=== [{label}] {command}\n")
            f.flush()
            try:
                rc = subprocess.run(
                    command, shell=True, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                    timeout=timeout, check=False,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = 124
            seconds = time.perf_counter() - start
            f.write(f"=== [{label}] rc={rc} in {seconds:.0f} s\n")
        status.append(f"{name:>9} | {label:<26} | rc {rc:>3} | {seconds:5.0f} s")
        print(status[-1], flush=True)
        if rc != 0:
            print("    " + "\n    ".join(log.read_text().splitlines()[-8:]), flush=True)
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("suites", nargs="*", help=f"one or more of: {', '.join(SUITES)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    ap.add_argument("--list", action="store_true", help="print the suites and exit")
    ap.add_argument(
        "--budget", type=float, default=float("inf"),
        help="seconds for all suites together: commands are cut at it, later ones skipped",
    )  # fmt: skip
    args = ap.parse_args()
    if args.list or not args.suites:
        for name, suite in SUITES.items():
            print(name)
            for label, timeout, command in suite:
                print(f"    {label} ({timeout} s): {command}")
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        print(
            f"error: unknown suite(s) {unknown}; choose from {', '.join(SUITES)}", file=sys.stderr
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _env(out)
    deadline = time.perf_counter() + args.budget
    status = [line for name in args.suites for line in run_suite(name, out, env, deadline)]
    if (out / "results.jsonl").exists():
        subprocess.run([sys.executable, "bench/side_by_side.py", str(out)], cwd=ROOT, env=env)
    print("\n".join(status))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
