"""What the CPU benches share: the metadata every row carries, where the rows go, and `vitjax.resize` held to its
numpy repetition."""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import platform
from pathlib import Path
from unittest import mock

import code_revision  # bench/ is on sys.path when a bench runs as a script

from vitjax import resize


def cpu_meta(device: str, packages: tuple[str, ...]) -> dict:
    """The machine, the date, the code, whether resizes ran PyTorch's kernel, and the versions that matter."""
    meta = {"device": device, "machine": platform.machine(), "date": datetime.date.today().isoformat()}
    meta["run"] = datetime.datetime.now().isoformat(timespec="seconds")
    meta.update(code_revision.revision())
    meta["torch_resize"] = resize.torch_is_exact()
    meta.update({name: md.version(name) for name in packages})
    return meta


def numpy_resize() -> mock._patch:
    """A context in which `vitjax.resize` runs its numpy repetition, the path without PyTorch."""
    return mock.patch.object(resize, "torch_is_exact", return_value=False)


def save_rows(rows: list[dict], out: Path, name: str, columns: dict[str, int]) -> None:
    """Append the rows to `out`/cpu-`name`-DATE.jsonl and print them as a table of `columns` (key: width) and ms."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"cpu-{name}-{rows[0]['date']}.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        print(" ".join(f"{r[key]:{width}}" for key, width in columns.items()), f"{r['ms']:9.1f} ms")
