"""Models named by their Hugging Face Hub id ("Qwen/Qwen3-VL-8B-Instruct"): the files the tower reads, found in the
Hugging Face cache or fetched into it by huggingface_hub (`HF_HUB_OFFLINE=1`: the cache only). Of a sharded full model
only config.json, the index and the shards that hold vision tensors are fetched; the language model's are not.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

from vitjax.weights import INDEX_FILE, CheckpointError, vision_shards

# owner/name as the hub spells repository ids.
HUB_ID = re.compile(r"\w[\w.-]*/\w[\w.-]*")
SINGLE_FILE = "model.safetensors"  # an unsharded checkpoint's one file, as `save_pretrained` names it


def hub_id(source: object) -> str | None:
    """`source` where it names a hub model rather than a local path: an owner/name string with nothing of that name
    here (a folder of that name wins, as in transformers) and no folder named like its owner (then it is a path that
    is not there: `checkpoints/qwen3-vl-8b` is no model on the hub)."""
    if isinstance(source, str) and HUB_ID.fullmatch(source) and not Path(source).parent.exists():
        return source
    return None


def model_folder(source: str | Path, config_only: bool = False, progress: bool = True) -> Path:
    """The local folder of a model: `source` itself, or a hub model's snapshot in the Hugging Face cache holding its
    config.json (`config_only`) or all the tower reads, fetched where missing (huggingface_hub's progress bars shown
    with `progress`). A hub model that cannot be had (unknown, gated, not reached, offline and not cached) is an
    OSError naming it; an index the hub gives that is none, a `CheckpointError`."""
    repo = hub_id(source)
    if repo is None:
        return Path(source)
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        with _bars(progress):
            folder = Path(hf_hub_download(repo, "config.json")).parent
            if config_only:
                return folder
            try:
                shards = vision_shards(Path(hf_hub_download(repo, INDEX_FILE)))
            except EntryNotFoundError as e:  # the hub has no index: one file holds the model
                if isinstance(e, LocalEntryNotFoundError) and not (folder / SINGLE_FILE).is_file():
                    raise  # the index is not in the cache, and the hub was not asked (offline) or not reached
                shards = [SINGLE_FILE]
            return Path(snapshot_download(repo, allow_patterns=["config.json", INDEX_FILE, *shards]))
    except CheckpointError:
        raise
    except (OSError, ValueError, EntryNotFoundError, *_http_errors()) as e:  # ValueError: an id the hub refuses
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OSError(f"{repo}: not a folder here, and the Hugging Face Hub did not give it ({reason})") from None


def _http_errors() -> tuple[type[Exception], ...]:
    """What huggingface_hub lets through of its HTTP client's errors: httpx's from 1.0, httpx2's from 2.0 (before,
    requests' OSErrors)."""
    found = []
    for client in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(client).HTTPError)
        except ImportError:
            continue
    return tuple(found)


@contextlib.contextmanager
def _bars(progress: bool) -> Iterator[None]:
    """huggingface_hub's progress bars off for the span, unless `progress` (they are process-wide: restored after)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = not progress and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        yield
    finally:
        if quiet:
            enable_progress_bars()
