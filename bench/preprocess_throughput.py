"""Throughput of ``mega-pretrain preprocess``: tokens/s for 1 and 2 workers, byte-level and a
``tokenizers`` BPE, from parquet and JSONL. CPU only; nothing is downloaded: the text is
generated here (Zipf-distributed words) and the BPE is trained on it here.

    uv run python bench/preprocess_throughput.py --mb 32 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mega_pretrain.data import HFTokenizer
from mega_pretrain.data.preprocess import preprocess


def _corpus(target_bytes: int, seed: int = 0) -> list[str]:
    """Documents of Zipf-distributed pseudo-words, 200-4,000 characters each."""
    rnd = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(1, 9))) for _ in range(20_000)]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    docs, size = [], 0
    while size < target_bytes:
        n = rnd.randint(40, 800)
        text = " ".join(rnd.choices(words, weights, k=n)) + ".\n"
        docs.append(text)
        size += len(text)
    return docs


def _bpe(docs: list[str], folder: Path, vocab_size: int) -> Path:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs[: max(1, len(docs) // 4)], trainer)
    path = folder / "bpe.json"
    tok.save(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32, help="MiB of text for the byte runs")
    parser.add_argument("--bpe-mb", type=float, default=8, help="MiB of text for the BPE runs")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = []
        for label, mb in (("byte", args.mb), ("bpe", args.bpe_mb)):
            docs = _corpus(int(mb * 2**20))
            # row groups of ~1 MiB, so that a shard of the default size can start at any of them
            pq.write_table(
                pa.table({"text": docs}), folder / f"{label}.parquet", row_group_size=400
            )
            with open(folder / f"{label}.jsonl", "w") as f:
                f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
            spec = "byte" if label == "byte" else f"hf:{_bpe(docs, folder, args.vocab)}"
            cases += [(label, spec, fmt) for fmt in ("parquet", "jsonl")]
        for label, spec, fmt in cases:
            tokenizer = spec if spec == "byte" else HFTokenizer(spec[3:])
            for workers in args.workers:  # stats.workers: at most one per shard
                source = folder / f"{label}.{fmt}"
                started = time.perf_counter()
                stats = preprocess(
                    source, folder / "out" / f"{label}-{fmt}-{workers}", tokenizer,
                    workers=workers, progress=False,
                )  # fmt: skip
                seconds = time.perf_counter() - started
                row = {
                    "tokenizer": label,
                    "format": fmt,
                    "workers": workers,
                    "shards": stats.shards,
                    "input_mib": round(source.stat().st_size / 2**20, 1),
                    "tokens": stats.tokens,
                    "seconds": round(seconds, 2),
                    "tokens_per_s": round(stats.tokens / seconds),
                    "tokens_per_s_per_worker": round(stats.tokens / seconds / stats.workers),
                }
                rows.append(row)
                print(
                    f"{label:>4} {fmt:>7} workers {workers}: {stats.tokens:>11,} tokens "
                    f"({row['input_mib']} MiB, {stats.shards} shards) in {seconds:6.2f} s = "
                    f"{row['tokens_per_s']:>10,} tokens/s, "
                    f"{row['tokens_per_s_per_worker']:>10,} per worker",
                    flush=True,
                )
    load = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"cpus {os.cpu_count()}, load average {load[0]:.1f}, commit {commit}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
