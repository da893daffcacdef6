"""Start a real SGLang HTTP server (stock, or through `bridge.launch_server`) on the CPU, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import requests

STUBS = Path(__file__).parent / "stubs"
CPU_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--mm-attention-backend", "sdpa",
    "--disable-cuda-graph", "--dtype", "float32", "--chunked-prefill-size", "32", "--max-total-tokens", "4096",
    "--log-level", "warning", "--host", "127.0.0.1",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(module: str, args: Sequence[str], log: Path, env: dict[str, str], timeout: float = 240) -> Iterator[str]:
    """`python -m MODULE ARGS --port P` in a process group of its own; yields its base URL once healthy."""
    port = free_port()
    environ = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(STUBS), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, *CPU_ARGS, "--port", str(port)],
            env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{module} not healthy after {timeout} s:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
