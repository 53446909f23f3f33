"""GPTModel at tp=2 (+SP) on two GPUs against tp=1 on each GPU, in bf16.

    torchrun --nproc-per-node 2 bench/gpt_tp_check.py

Prints the relative difference ||tp2 - tp1|| / ||tp1|| of the loss and of every gathered
gradient; bf16 operands give 1e-3..1e-2 (METHOD.md), anything larger is a bug.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mega_models import GPTModel, finalize_model_grads, model_config
from mega_parallel_grid import ParallelConfig, init_process_groups
from mega_parallel_grid.testing import solo_groups
from mega_tp_layers import gather_full, shard_spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    groups = init_process_groups(ParallelConfig(tp=2))
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    config = model_config("1b").replace(num_layers=args.layers)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen).to(dev)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for label, g, sp in (
        ("tp1", solo_groups(), False),
        ("tp2", groups, False),
        ("tp2+sp", groups, True),
    ):
        model = GPTModel(config, g, sequence_parallel=sp, seed=5, device=dev, dtype=torch.bfloat16)
        loss = model(ids, labels).float().mean()
        loss.backward()
        finalize_model_grads(model, g)  # SP: sum the norms' partial gradients over tp
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad
            assert grad is not None
            spec = shard_spec(p)
            if spec is not None and spec.dim is not None and spec.num_shards > 1:
                grad = gather_full(grad, spec, g.tp)
            grads[name] = (
                grad[: config.vocab_size].float()
                if "embedding" in name or "output" in name
                else grad.float()
            )
        results[label] = (loss.detach(), grads)
        del model
    ref_loss, ref_grads = results["tp1"]
    rows = []
    for label in ("tp2", "tp2+sp"):
        loss, grads = results[label]
        worst = max(
            float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30))
            for n in ref_grads
        )
        rows.append(
            (
                label,
                float(ref_loss),
                float(loss),
                abs(float(loss - ref_loss)) / float(ref_loss),
                worst,
            )
        )
    if dist.get_rank() == 0:
        print(
            f"{'layout':<8} {'loss tp1':>10} {'loss':>10} {'rel loss diff':>14} {'worst rel grad diff':>20}"
        )
        for label, a, b, dl, dg in rows:
            print(f"{label:<8} {a:>10.5f} {b:>10.5f} {dl:>14.2e} {dg:>20.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
