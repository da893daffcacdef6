"""HF safetensors -> vitjax parameters (strict, streamed), and the converted orbax format.

The map is an explicit table generated from the config: every tensor the tower needs has exactly one
HF name, so missing, unexpected and mis-shaped tensors are all reported by name.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors reads bf16 tensors as numpy)
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from vitjax.config import VisionConfig
from vitjax.leftovers import remove_stale

PREFIXES = ("model.visual.", "visual.")
# Tensors under these prefixes are a vision tower of another model family: refuse rather than misload.
FOREIGN_PREFIXES = ("thinker.visual.", "visual.merger.ln_q", "model.visual.merger.ln_q")
BUFFERS = ("rotary_pos_emb.inv_freq", "rotary_pos_emb.original_inv_freq")
# The floating-point dtypes of the safetensors format numpy reads (FP8 ones it cannot).
SAFETENSORS_FLOATS = ("F16", "BF16", "F32", "F64")
FLOATS = ("float16", "bfloat16", "float32", "float64")
QUANTIZED = " (a quantized vision tower? vitjax reads its weights unquantized, as SGLang's tower does)"
INDEX_FILE = "model.safetensors.index.json"
ORBAX_PARAMS = "params"
# A conversion is staged in a folder beside its output, renamed into place once whole. One a killed process left is
# removed by a later conversion there once this old (a conversion may wait hours on the hub for its weights).
STAGING_PATTERN = ".vitjax-convert-*.partial"
STALE_STAGING_SECONDS = 24 * 3600

Params = dict[str, Any]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the configured tower; the message names the tensor and the file."""


class Target(NamedTuple):
    path: tuple[str, ...]  # into the nested parameter dict
    index: int | None  # position on the stacked leading axis (blocks, deepstack mergers)
    kind: str  # "linear" (transpose), "conv" (Conv3d -> dense kernel) or "copy"
    shape: tuple[int, ...]  # the HF tensor's shape


def weight_map(cfg: VisionConfig) -> dict[str, Target]:
    """HF tensor name (without prefix) -> where it goes in vitjax's parameter tree."""
    d, wide, out = cfg.hidden_size, cfg.hidden_size * cfg.merge_unit, cfg.out_hidden_size
    table: dict[str, Target] = {}

    def linear(hf: str, path: tuple[str, ...], din: int, dout: int, index: int | None = None) -> None:
        table[f"{hf}.weight"] = Target((*path, "kernel"), index, "linear", (dout, din))
        table[f"{hf}.bias"] = Target((*path, "bias"), index, "copy", (dout,))

    def norm(hf: str, path: tuple[str, ...], dim: int, index: int | None = None) -> None:
        table[f"{hf}.weight"] = Target((*path, "scale"), index, "copy", (dim,))
        table[f"{hf}.bias"] = Target((*path, "bias"), index, "copy", (dim,))

    conv = (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    table["patch_embed.proj.weight"] = Target(("patch_embed", "proj", "kernel"), None, "conv", conv)
    table["patch_embed.proj.bias"] = Target(("patch_embed", "proj", "bias"), None, "copy", (d,))
    table["pos_embed.weight"] = Target(("pos_embed", "embedding"), None, "copy", (cfg.num_position_embeddings, d))
    for i in range(cfg.depth):
        b = f"blocks.{i}"
        norm(f"{b}.norm1", ("blocks", "norm1"), d, i)
        norm(f"{b}.norm2", ("blocks", "norm2"), d, i)
        linear(f"{b}.attn.qkv", ("blocks", "attn", "qkv"), d, 3 * d, i)
        linear(f"{b}.attn.proj", ("blocks", "attn", "proj"), d, d, i)
        linear(f"{b}.mlp.linear_fc1", ("blocks", "mlp", "linear_fc1"), d, cfg.intermediate_size, i)
        linear(f"{b}.mlp.linear_fc2", ("blocks", "mlp", "linear_fc2"), cfg.intermediate_size, d, i)
    norm("merger.norm", ("merger", "norm"), d)
    linear("merger.linear_fc1", ("merger", "linear_fc1"), wide, wide)
    linear("merger.linear_fc2", ("merger", "linear_fc2"), wide, out)
    for k in range(len(cfg.deepstack_visual_indexes)):
        m, path = f"deepstack_merger_list.{k}", ("deepstack_merger_list",)
        norm(f"{m}.norm", (*path, "norm"), wide, k)
        linear(f"{m}.linear_fc1", (*path, "linear_fc1"), wide, wide, k)
        linear(f"{m}.linear_fc2", (*path, "linear_fc2"), wide, out, k)
    return table


def _vmap_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    if kind == "linear":
        return shape[::-1]
    if kind == "conv":
        return (int(np.prod(shape[1:])), shape[0])
    return shape


def _leaf_shape(target: Target, cfg: VisionConfig) -> tuple[int, ...]:
    """The shape of `target`'s leaf in the parameter tree: stacked leaves lead with the block or merger count."""
    shape = _vmap_shape(target.shape, target.kind)
    if target.index is None:
        return shape
    return (cfg.depth if target.path[0] == "blocks" else len(cfg.deepstack_visual_indexes), *shape)


def _check_dtype(where: str, key: str, dtype: Any) -> None:
    """Weights are 16-, 32- or 64-bit floats: an integer, boolean or 8-bit float tensor (a quantized tower's codes,
    whose scales are other tensors) would be cast silently into nonsense."""
    if np.dtype(dtype).name not in FLOATS:
        raise CheckpointError(
            f"{where}: tensor {key} has dtype {np.dtype(dtype)}, expected one of {', '.join(FLOATS)}{QUANTIZED}"
        )


def _transform(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "linear":
        return x.T
    if kind == "conv":
        return x.reshape(x.shape[0], -1).T
    return x


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory (sharded through its index, or all of them) or one file."""
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        names = vision_shards(index)
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are not there: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def vision_shards(index: Path) -> list[str]:
    """The shard files a sharded checkpoint's index names for the vision tower; the rest are never read."""
    try:
        weight_map_ = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:  # unreadable, not JSON, not an object
        raise CheckpointError(f"{index}: not a readable index ({e})") from None
    if (
        not isinstance(weight_map_, dict)
        or not weight_map_
        or not all(isinstance(f, str) for f in weight_map_.values())
    ):
        raise CheckpointError(f"{index}: not a readable index (its weight_map must map tensor names to file names)")
    # A vision-only checkpoint has bare names: then every shard is the tower's.
    return sorted({f for k, f in weight_map_.items() if k.startswith(PREFIXES)} or set(weight_map_.values()))


def _visual_keys(files: list[Path]) -> list[tuple[Path, str, str]]:
    """(file, full key, key without prefix) for the vision tensors; other tensors are never read.

    Full-model checkpoints prefix the tower with `model.visual.` (or `visual.` in some splits); a
    vision-only `save_pretrained` has bare names.
    """
    keys: list[tuple[Path, str]] = []
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                keys.extend((file, k) for k in f.keys())  # noqa: SIM118 (not a dict)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    foreign = [k for _, k in keys if k.startswith(FOREIGN_PREFIXES)]
    if foreign:
        raise CheckpointError(f"tensor {foreign[0]} belongs to a different vision tower (not Qwen3-VL)")
    found = [p for p in PREFIXES if any(k.startswith(p) for _, k in keys)]
    if len(found) > 1:
        raise CheckpointError(f"vision tensors under several prefixes {found}")
    prefix = found[0] if found else ""
    if not found and not any(k == "patch_embed.proj.weight" for _, k in keys):
        return []
    return [(file, k, k[len(prefix) :]) for file, k in keys if k.startswith(prefix)]


class _Assembler:
    """Places HF-named vision tensors into the nested parameter dict, strictly: every unexpected,
    repeated or mis-shaped tensor is an error naming it and `where` it came from. Into a copy of a whole
    tower's parameters (`base`), it is an update: tensors not given keep their values, and it updates as SGLang's own
    loader does (a server's weight update must not fail where stock SGLang's succeeds): a name the tower lacks is
    skipped with a warning, a tensor given twice takes its last value; a mis-shaped one is still an error."""

    def __init__(self, cfg: VisionConfig, prefix: str, base: Params | None = None):
        self.cfg, self.prefix = cfg, prefix
        self.table = weight_map(cfg)
        self.params: Params = base if base is not None else {}
        self.update = base is not None
        self.seen: set[str] = set()

    def add(self, where: str, name: str, shape: tuple[int, ...], read: Callable[[], np.ndarray]) -> None:
        """Take tensor `name` (prefix stripped) of `shape`; `read` is called only once it is known to fit."""
        if name in BUFFERS:
            return
        key, target = self.prefix + name, self.table.get(name)
        if target is None and self.update:
            warnings.warn(f"{where}: tensor {key} is none of the {self.cfg.depth}-block tower's; skipped", stacklevel=4)
            return
        if target is None:
            raise CheckpointError(f"{where}: unexpected tensor {key} for a {self.cfg.depth}-block tower")
        if name in self.seen and not self.update:
            raise CheckpointError(f"{where}: tensor {key} appears twice")
        if shape != target.shape:
            raise CheckpointError(f"{where}: tensor {key} has shape {list(shape)}, expected {list(target.shape)}")
        value = read()
        _check_dtype(where, key, value.dtype)
        _place(self.params, target, _transform(value, target.kind), self.cfg, promote=not self.update)
        self.seen.add(name)

    def check_complete(self, where: str, names: Iterable[str]) -> None:
        """Every tensor of the tower is among `names` (an update may carry any of them)."""
        names = set(names)
        missing = [] if self.update else [k for k in self.table if k not in names]
        if missing:
            shown = ", ".join(self.prefix + k for k in missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise CheckpointError(f"{where}: {len(missing)} vision tensors missing: {shown}")

    def finish(self, where: str) -> Params:
        self.check_complete(where, self.seen)
        return self.params


def load_hf(path: str | Path, cfg: VisionConfig, progress: bool = False) -> Params:
    """Read the vision tower out of an HF checkpoint (full model or vision-only, single or sharded).

    Returns the nested parameter dict in the checkpoint's own dtype. Language-model tensors are skipped
    without being read; anything missing, unexpected or mis-shaped raises `CheckpointError` naming it.
    """
    files = _checkpoint_files(Path(path))
    entries = _visual_keys(files)
    if not entries:
        raise CheckpointError(f"{path}: no vision tower tensors ({' or '.join(p + '*' for p in PREFIXES)})")
    assembler = _Assembler(cfg, entries[0][1][: len(entries[0][1]) - len(entries[0][2])])
    assembler.check_complete(str(path), (name for _, _, name in entries))  # before any tensor is read
    open_files: dict[Path, Any] = {}
    try:
        for file, key, name in tqdm(entries, desc="loading vision tower", disable=not progress, unit="tensor"):
            f = open_files.get(file) or open_files.setdefault(file, safe_open(file, framework="numpy"))
            tensor = f.get_slice(key)
            if name not in BUFFERS and tensor.get_dtype() not in SAFETENSORS_FLOATS:  # FP8 would not even read
                raise CheckpointError(
                    f"{file}: tensor {key} has dtype {tensor.get_dtype()}, expected one of {SAFETENSORS_FLOATS}"
                    + QUANTIZED
                )
            assembler.add(str(file), name, tuple(tensor.get_shape()), lambda f=f, key=key: f.get_tensor(key))
    finally:
        open_files.clear()
    return assembler.finish(str(path))


def from_named_arrays(
    tensors: Iterable[tuple[str, np.ndarray]], cfg: VisionConfig, where: str, base: Params | None = None
) -> Params:
    """The tower from (HF name, array) pairs, e.g. a serving framework's weight iterator: names carry the
    `model.visual.` or `visual.` prefix (or none); the checks are `load_hf`'s. With `base` (a whole tower's
    parameters, written into) the pairs are an update and may be any of the tensors (`_Assembler` says how an
    update is checked)."""
    assembler: _Assembler | None = None
    for key, value in tensors:
        prefix = next((p for p in PREFIXES if key.startswith(p)), "")
        if assembler is None:
            assembler = _Assembler(cfg, prefix, base)
        elif prefix != assembler.prefix:
            raise CheckpointError(f"{where}: vision tensors under several prefixes {[assembler.prefix, prefix]}")
        assembler.add(where, key[len(prefix) :], tuple(value.shape), lambda value=value: value)
    if assembler is None:
        raise CheckpointError(f"{where}: no vision tower tensors")
    return assembler.finish(where)


def _place(params: Params, target: Target, value: np.ndarray, cfg: VisionConfig, promote: bool) -> None:
    """Store one tensor, allocating stacked arrays on first use. With `promote`, a stacked array takes the widest
    dtype of its blocks (HF keeps each tensor's own); an update is written in the dtype of the weights it changes."""
    node = params
    for part in target.path[:-1]:
        node = node.setdefault(part, {})
    leaf = target.path[-1]
    if target.index is None:
        node[leaf] = np.ascontiguousarray(value)
        return
    if leaf not in node:
        node[leaf] = np.empty(_leaf_shape(target, cfg), value.dtype)
    if promote and (wider := jnp.promote_types(node[leaf].dtype, value.dtype)) != node[leaf].dtype:
        node[leaf] = node[leaf].astype(wider)
    node[leaf][target.index] = value


def save_orbax(out_dir: str | Path, cfg: VisionConfig, params: Params) -> Path:
    """Write a converted checkpoint: `config.json` (vision config) and `params/` (orbax)."""
    import orbax.checkpoint as ocp

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / ORBAX_PARAMS, params, force=True)
    return out


def is_orbax(path: str | Path) -> bool:
    return (Path(path) / ORBAX_PARAMS).is_dir()


def load_orbax(path: str | Path) -> tuple[VisionConfig, Params]:
    """Read a checkpoint written by `save_orbax`, held to its config as strictly as `load_hf` holds an HF one."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg = VisionConfig.from_hf(path / "config.json")
    _quiet_closed_loop_reports()
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = jax.tree.map(np.asarray, ckpt.restore(path / ORBAX_PARAMS))
    except Exception as e:  # orbax and tensorstore report damage as many kinds (a KeyError for metadata without a key)
        where, said = path / ORBAX_PARAMS, str(e).split(" [tensorstore_spec=")[0]  # the spec: a kilobyte of JSON
        raise CheckpointError(f"{where}: not a readable converted checkpoint ({type(e).__name__}: {said})") from None
    check_params(params, cfg, str(path / ORBAX_PARAMS))
    return cfg, params


def _quiet_closed_loop_reports() -> None:
    """After a failed restore tensorstore still completes the reads in flight, on orbax's event loop, which is closed
    by then: each completion reports "Event loop is closed" through `sys.unraisablehook`, bare tracebacks after our
    error. Those reports, and only those, are dropped from the first restore on."""
    previous = sys.unraisablehook
    if getattr(previous, "vitjax_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
        if not (closed and unraisable.object is None):
            previous(unraisable)

    hook.vitjax_quiet = True
    sys.unraisablehook = hook


def check_params(params: Params, cfg: VisionConfig, where: str) -> None:
    """Every leaf the config's tower needs, at its shape and floating point, and nothing else."""
    expected = {"/".join(t.path): _leaf_shape(t, cfg) for t in weight_map(cfg).values()}
    found = {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    missing = [k for k in expected if k not in found]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{where}: {len(missing)} parameters missing: {shown}")
    for key, leaf in found.items():
        if key not in expected:
            raise CheckpointError(f"{where}: unexpected parameter {key} for a {cfg.depth}-block tower")
        if leaf.shape != expected[key]:
            raise CheckpointError(
                f"{where}: parameter {key} has shape {list(leaf.shape)}, expected {list(expected[key])}"
            )
        _check_dtype(where, key, leaf.dtype)


def _uninterrupted(work: Callable[[], Any]) -> Any:
    """`work()` run to its end in a thread of its own, an interrupt of this thread meanwhile (Ctrl-C, SIGTERM's
    exception) raised only once it has ended. Orbax writes from threads that outlive an interrupt of its caller: a
    folder removed at once would be written into again (and orbax reports each write it loses)."""
    with ThreadPoolExecutor(1, thread_name_prefix="vitjax-save") as pool:
        done, interrupt = pool.submit(work), None
        while True:
            try:
                result = done.result()
                break
            except BaseException as e:
                if done.done():  # the work's own failure (or the interrupt it raised itself), after any interrupt here
                    if interrupt is not None and interrupt is not e:
                        raise interrupt from e
                    raise
                interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
    return result


def convert(hf_dir: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """HF directory (or hub id, `vitjax.hub`) -> converted orbax directory (the vision tower only), written whole or
    not at all: into a new folder beside `out_dir`, renamed into place once complete (replacing an earlier conversion
    there). A hub model's weights are fetched once its config and `out_dir` passed the checks."""
    from vitjax import hub  # it reads this module's index rule

    source, out = hub.model_folder(hf_dir, True, progress).absolute(), Path(out_dir).absolute()
    if out.is_symlink():  # the conversion replaces the link's target, and the link stays
        out = out.resolve()
    if not source.is_dir():
        raise CheckpointError(f"{source}: not a folder (an HF checkpoint is one: config.json and *.safetensors)")
    if out.resolve() == source.resolve():
        raise CheckpointError(f"{out}: is the checkpoint being converted; write the conversion elsewhere")
    earlier = out.is_dir() and {p.name for p in out.iterdir()} == {"config.json", ORBAX_PARAMS}
    if out.exists() and not earlier and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not a converted checkpoint (config.json and params/ only)")
    if not out.parent.is_dir():
        raise CheckpointError(f"{out.parent}: no such folder")
    cfg = VisionConfig.from_hf(source)
    remove_stale(out.parent, STAGING_PATTERN, STALE_STAGING_SECONDS)
    tag = uuid.uuid4().hex[:8]
    # Short fixed names: one built from `out`'s would pass the 255-byte limit on a file name before `out` does.
    staging = out.parent / STAGING_PATTERN.replace("*", tag)
    old = out.parent / f".vitjax-convert-{tag}.old"
    staging.mkdir()  # before any tensor is read: the folder must be writable (and the umask sets its mode)
    try:
        params = load_hf(hub.model_folder(hf_dir, progress=progress).absolute(), cfg, progress=progress)
        _uninterrupted(lambda: save_orbax(staging, cfg, params))
        try:  # the earlier conversion (or an empty folder) goes only once the new one is in place
            if out.exists():
                out.rename(old)
            staging.rename(out)
        except BaseException:  # an interrupt between the two renames too
            if old.exists():
                old.rename(out)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
