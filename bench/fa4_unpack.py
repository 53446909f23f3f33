"""On the GPU machine: put FlashAttention-4 and what it needs into one site folder, from the
two halves ``bench/fa4_wheels.sh`` made (the CuTe DSL library as split tar.xz parts, the
other wheels whole). Run from the repository root of the carried tree:

    python3 bench/fa4_unpack.py /tmp/fa4site ../../.fa4keep .fa4/b

then put the site folder and its ``nvidia_cutlass_dsl/dsl_packages`` first on ``PYTHONPATH``
(the folder ``nvidia-cutlass-dsl``'s ``.pth`` file adds in a site directory, which a
``--target`` folder is not). Exits non-zero with one line if a part is
missing; prints what it installed.
"""

from __future__ import annotations

import io
import lzma
import subprocess
import sys
import tarfile
from pathlib import Path


def main(site: str, *folders: str) -> int:
    parts = sorted(p for f in folders for p in Path(f).glob("cu13.tar.xz.part*"))
    if [p.name[-2:] for p in parts] != ["00", "01"]:
        print(f"fa4_unpack: want parts 00 and 01 of cu13.tar.xz, found {[str(p) for p in parts]}")
        return 2
    wheels = [str(w) for f in folders for w in Path(f).glob("*.whl")]
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--upgrade", "--target", site, *wheels],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if pip.returncode != 0:
        last = (pip.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"fa4_unpack: pip could not install {len(wheels)} wheels into {site}: {last}")
        return 1
    # after pip: with --upgrade it replaces a top-level folder it installs into
    # (nvidia_cutlass_dsl, which the library shares with nvidia-cutlass-dsl-libs-base)
    data = lzma.decompress(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(site, filter="data")
    print(f"fa4_unpack: {len(data) / 2**20:.0f} MiB of the CuTe DSL library and "
          f"{len(wheels)} wheels into {site}")  # fmt: skip
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], *sys.argv[2:]))
