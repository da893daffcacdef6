"""Which code a benchmark row measured, recorded in the row itself.

The GPU machine gets a copy of the working tree whose `.git`, where there is one, is not the tree's (one said
d5b99fa, dirty, of a tree at 98c1aff), so rows record the code instead: `code`, a digest of the Python files under
vitjax/, bridge/ and bench/ (paths and contents; untracked ones count, since they ran too, so a row made beside a
stray script matches no commit). A row's digest names its commit here:

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
    show = ["git", "-C", str(ROOT), "show"]
    try:
        return [(p, subprocess.run([*show, f"{rev}:{p}"], capture_output=True, check=True).stdout) for p in paths]
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"code_revision: git show {rev}: {e.stderr.decode().strip()}") from None


def revision() -> dict:
    """{"code": the digest of this tree's vitjax/, bridge/ and bench/}."""
    return {"code": digest(tree_files())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="*", help="commits (default: the working tree)")
    args = ap.parse_args()
    if not args.revs:
        print(revision()["code"])
    for rev in args.revs:
        print(rev, digest(commit_files(rev)))


if __name__ == "__main__":
    main()
