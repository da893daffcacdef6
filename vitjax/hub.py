"""Models named by their Hugging Face Hub id ("Qwen/Qwen3-VL-8B-Instruct"): the files the tower reads, found in the
Hugging Face cache or fetched into it by huggingface_hub (`HF_HUB_OFFLINE=1`: the cache only). Of a sharded full model
only config.json, the index and the shards that hold vision tensors are fetched; the language model's are not.
"""

from __future__ import annotations

import re
from pathlib import Path

from vitjax.weights import INDEX_FILE, CheckpointError, vision_shards

# owner/name as the hub spells repository ids; a local path of that name wins, as in transformers.
HUB_ID = re.compile(r"\w[\w.-]*/\w[\w.-]*")


def hub_id(source: object) -> str | None:
    """`source` where it names a hub model rather than a local path: owner/name, and nothing of that name here."""
    if isinstance(source, str) and HUB_ID.fullmatch(source) and not Path(source).exists():
        return source
    return None


def model_folder(source: str | Path, config_only: bool = False) -> Path:
    """The local folder of a model: `source` itself, or a hub model's snapshot in the Hugging Face cache holding its
    config.json (`config_only`) or all the tower reads, fetched where missing. A hub model that cannot be had
    (unknown, gated, offline and not cached) is an OSError naming it."""
    repo = hub_id(source)
    if repo is None:
        return Path(source)
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        folder = Path(hf_hub_download(repo, "config.json")).parent
        if config_only:
            return folder
        try:
            shards = vision_shards(Path(hf_hub_download(repo, INDEX_FILE)))
        except EntryNotFoundError:  # one file holds the model (or, offline, the index is not in the cache)
            shards = ["*.safetensors"]
        return Path(snapshot_download(repo, allow_patterns=["config.json", INDEX_FILE, *shards]))
    except CheckpointError:  # the hub gave an index that is none
        raise
    except (OSError, ValueError, EntryNotFoundError) as e:  # ValueError: an id the hub refuses as one
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OSError(f"{repo}: not a folder here, and the Hugging Face Hub did not give it ({reason})") from None
