"""What the CPU benches share: the metadata every row carries, and `vitjax.resize` held to its numpy repetition."""

from __future__ import annotations

import datetime
import importlib.metadata as md
import platform
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
