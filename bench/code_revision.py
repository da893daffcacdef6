"""Which code a benchmark row measured, recorded in the row itself.

The GPU machine gets a copy of the working tree without `.git`, so a commit cannot be read there; what can be is
the code. Every row carries `code`, a digest of the Python files under vitjax/, bridge/ and bench/ (paths and
contents), and, where the tree is a git checkout, `commit` and whether those folders differ from it (`dirty`).
A row's digest names its commit here:

    python bench/code_revision.py [REV ...]      # the digest of each commit (default: the working tree)
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("vitjax", "bridge", "bench")


def digest(files: Iterable[tuple[str, bytes]]) -> str:
    """12 hex digits of SHA-256 over (path, contents) pairs, in path order."""
    h = hashlib.sha256()
    for path, data in sorted(files):
        h.update(path.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:12]


def tree_files() -> list[tuple[str, bytes]]:
    return [
        (path.relative_to(ROOT).as_posix(), path.read_bytes())
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    ]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode()


def commit_files(rev: str) -> list[tuple[str, bytes]]:
    listing = _git("ls-tree", "-r", "--name-only", rev, "--", *FOLDERS)
    if listing is None:
        raise SystemExit(f"code_revision: no commit {rev!r} here")
    paths = [p for p in listing.splitlines() if p.endswith(".py")]
    return [
        (p, subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{p}"], capture_output=True).stdout) for p in paths
    ]


def revision() -> dict:
    """{"code": digest of the tree, "commit": HEAD or None, "dirty": the folders differ from HEAD (None: no git)}."""
    commit = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--", *FOLDERS) if commit else None
    return {
        "code": digest(tree_files()),
        "commit": commit.strip() if commit else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="*", help="commits (default: the working tree)")
    args = ap.parse_args()
    if not args.revs:
        print(revision())
    for rev in args.revs:
        print(rev, digest(commit_files(rev)))


if __name__ == "__main__":
    main()
