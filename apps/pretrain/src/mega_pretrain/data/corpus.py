"""The embedded default corpus: the running interpreter's own standard-library sources.

Every machine with Python has them, so ``mega-pretrain`` trains out of the box without a
download. The selection is bounded (a few MB) and deterministic for a given interpreter, and
is tokenized byte-level once into a cache folder.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import uuid
from pathlib import Path

from mega_pretrain.data.errors import DataError
from mega_pretrain.data.indexed import IndexedTokenDataset
from mega_pretrain.data.preprocess import preprocess
from mega_pretrain.data.tokenizers import ByteTokenizer

__all__ = ["default_cache_dir", "default_corpus", "ensure_default_dataset"]

#: Folders of the standard library left out: tests (odd encodings, fixtures) and installed
#: third-party packages.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_FORMAT = "stdlib-byte-v1"  # bump when the selection rule or the file format changes


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus(
    *,
    max_bytes: int = 8 * 2**20,
    max_files: int = 2000,
    max_file_bytes: int = 256 * 2**10,
    root: str | Path | None = None,
) -> list[Path]:
    """The standard library's ``.py`` files: a bounded, deterministic selection.

    Files are taken in a fixed pseudo-random order (the SHA-1 of each path relative to the
    library root), so that a bounded selection samples the whole library rather than its
    first letters; a file that would take the total past ``max_bytes`` is passed over, as are
    empty files, files over ``max_file_bytes`` (generated data tables) and the folders
    ``test``, ``tests``, ``idle_test``, ``site-packages`` and ``dist-packages``. At most
    ``max_files`` files. ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``.
    """
    base = _stdlib_root() if root is None else Path(root)
    sources: list[tuple[bytes, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [
            d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith((".", "__pycache__"))
        ]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            size = path.stat().st_size
            if 0 < size <= max_file_bytes:
                rel = path.relative_to(base).as_posix()
                sources.append((hashlib.sha1(rel.encode()).digest(), path, size))
    sources.sort()
    chosen: list[Path] = []
    total = 0
    for _, path, size in sources:
        if len(chosen) >= max_files:
            break
        if total + size <= max_bytes:
            chosen.append(path)
            total += size
    if not chosen:
        raise DataError(
            f"found no Python source files under {base} to train on; "
            "give your own data with `mega-pretrain preprocess`"
        )
    return chosen


def default_cache_dir() -> Path:
    """``$MEGA_PRETRAIN_CACHE``, else ``$XDG_CACHE_HOME/mega-pretrain``, else ``~/.cache/mega-pretrain``."""
    if os.environ.get("MEGA_PRETRAIN_CACHE"):
        return Path(os.environ["MEGA_PRETRAIN_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mega-pretrain"


def ensure_default_dataset(
    cache_dir: str | Path | None = None,
    *,
    max_bytes: int = 8 * 2**20,
    max_files: int = 2000,
    progress: bool = False,
) -> Path:
    """The prefix of the default corpus, tokenized byte-level; preprocessed on first use.

    The cache entry's name holds a digest of the interpreter version, the selection and the
    format, so another Python (or other bounds) gets its own entry; an entry that exists and
    opens as a valid pair is reused. Several processes may call this at once: each writes
    its own temporary files and the identical results replace each other atomically.
    """
    files = default_corpus(max_bytes=max_bytes, max_files=max_files)
    root = _stdlib_root()
    digest = hashlib.sha256(f"{_FORMAT}\n{sys.version}\n".encode())
    for path in files:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        digest.update(f"{rel}\t{path.stat().st_size}\n".encode())
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    cache = default_cache_dir() if cache_dir is None else Path(cache_dir)
    prefix = cache / f"stdlib-py{version}-byte-{digest.hexdigest()[:12]}"
    try:
        IndexedTokenDataset(prefix)
        return prefix
    except DataError:
        pass
    # preprocess keeps resumable shards beside its output prefix, which concurrent callers
    # must not share: each writes under a private prefix, then renames the pair into place
    private = prefix.with_name(f"{prefix.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    preprocess(files, private, ByteTokenizer(), progress=progress)
    for suffix in (".bin", ".idx"):  # .bin first: an .idx never names a missing .bin
        os.replace(private.with_name(private.name + suffix), prefix.with_name(prefix.name + suffix))
    return prefix
