"""`vitjax` command line: encode images and videos to a safetensors file, or convert an HF checkpoint."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

import vitjax
from vitjax.attention import ENV_VAR, check_devices, named_implementation
from vitjax.buckets import FIT_GRANULE, BucketPolicy
from vitjax.config import PRESETS, VisionConfig
from vitjax.encoder import DTYPES
from vitjax.hub import model_folder
from vitjax.images import ImageInputError, expand_inputs, path_error
from vitjax.leftovers import remove_stale
from vitjax.pipeline import DECODERS
from vitjax.preprocess import IMAGE_PROCESSOR_BACKENDS, MAX_PIXELS, MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from vitjax.settings import BATCH_TOKENS, PIXEL_LIMIT, EncodeSettings, SettingError
from vitjax.video import FPS, MAX_FRAMES, is_video_path

EPILOG = """examples:
  vitjax encode photos/ --random-init qwen3-vl-2b -o embeds.safetensors
  vitjax encode a.jpg b.png --model checkpoints/qwen3-vl-8b -o embeds.safetensors
  vitjax encode clip.mp4 photos/ --fps 1 --model checkpoints/qwen3-vl-8b -o embeds.safetensors
  find photos -name '*.jpg' | vitjax encode --files-from - --model checkpoints/qwen3-vl-8b -o embeds.safetensors
  vitjax convert /path/to/Qwen3-VL-8B-Instruct checkpoints/qwen3-vl-8b"""

EXIT_CODES = """exit status:
  0  every input was encoded and written
  1  some inputs failed (each is named on stderr; the others are written), the output could not be written, or
     the --summary json line could not be (standard output closed or full; the output is written)
  2  usage: a bad option or setting, an unknown preset, an unreadable --model, an output folder that is
     missing or not writable; nothing is encoded
  3  the run itself failed (out of memory, a defect: the traceback is on stderr); nothing was written
  129, 130, 143
     hung up (SIGHUP), interrupted (Ctrl-C) or terminated (SIGTERM); nothing half-written is left"""


# Of the probe and temporary files beside the output: fixed and short, as one built from the output's name would pass
# the 255-byte limit on a file name before the output's name does.
TEMP_PREFIX = ".vitjax-"
# Inputs go to the encoder a chunk at a time, and a chunk's embeddings are copied to the host once the next chunk is
# dispatched, so the device holds two chunks' at most (all of a folder's would not fit: a 12 MP photo's are 366 MiB
# on the 8B tower). A chunk holds as many inputs as fit CHUNK_BYTES at the largest embedding the settings allow: 32
# on the 8B tower at the default max_pixels (512 MiB each; the 20 photos of the benchmarks in one chunk).
CHUNK_BYTES = 16 << 30


class UsageError(Exception):
    """A problem with the command line itself, found before any work: one line on stderr, exit status 2."""


class Terminated(BaseException):
    """SIGTERM (a scheduler, `timeout`, `docker stop`) or SIGHUP (the terminal or ssh session closed), raised where
    the program is so that the cleanup of partial outputs runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# Signals that stop a run, each cleaned up as Ctrl-C is; one the process was started ignoring (`nohup`, a shell's
# background job) stays ignored.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_stop_signals: list[int] = []  # received since `main` began


def _stopped(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_stop_signal(signum: int, frame: object) -> None:
    _stop_signals.append(signum)
    raise _stopped(signum)


def _check_stop_signals() -> None:
    """Raise for a stop signal whose exception Python dropped: one that came while a `__del__` or a garbage
    collector's callback ran (tqdm's bar, JAX's arrays) is printed as ignored, and the run went on."""
    if _stop_signals:
        raise _stopped(_stop_signals[0])


def _device_count(text: str) -> int | str:
    if text == "all":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive count or 'all', got {text!r}")


def _seed(text: str) -> int:
    if re.fullmatch(r"-?[0-9]+", text) and -(2**63) <= int(text) < 2**63:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a whole number from -2**63 to 2**63 - 1, got {text!r}")


def _inputs(args: argparse.Namespace) -> list[str | Path]:
    """The positional inputs, then those of --files-from (one per line, blank lines skipped)."""
    inputs = list(args.inputs)
    if args.files_from is not None:
        try:
            if args.files_from != "-":
                data = Path(args.files_from).read_bytes()
            else:  # a text stream without bytes underneath (an embedding caller's) gives its text back as bytes
                stdin = getattr(sys.stdin, "buffer", None)
                data = stdin.read() if stdin is not None else os.fsencode(sys.stdin.read())
        except OSError as e:
            raise UsageError(f"--files-from {args.files_from}: cannot read ({e.strerror or e})") from e
        # One name per line, whatever its bytes: decoded as the command line is, split at newlines only.
        lines = (os.fsdecode(line.removesuffix(b"\r")) for line in data.split(b"\n"))
        inputs += [line for line in lines if line.strip()]
    # Inputs here name files: one whose name starts with "data:" is a file, not a data URI.
    inputs = [Path(i) if i.startswith("data:") else i for i in inputs]
    if not inputs:
        raise UsageError("no inputs: name image or video files or folders, or pass --files-from FILE (- for stdin)")
    return inputs


def _config(args: argparse.Namespace) -> VisionConfig:
    """The tower's config, read without building the model: from the preset or --model's config.json."""
    if args.random_init is not None:
        try:
            args.random_init = VisionConfig.preset_name(args.random_init)  # so the output records the preset's name
        except ValueError as e:
            raise UsageError(f"--random-init {args.random_init}: {e}") from e
        return VisionConfig.preset(args.random_init)
    try:
        path = model_folder(args.model, config_only=True, progress=not args.quiet)
    except OSError as e:  # a hub id the hub did not give
        raise UsageError(f"--model {e}") from e
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise UsageError(f"--model {args.model}: {what} (an HF checkpoint, a `vitjax convert` output or a hub id)")
    try:
        return VisionConfig.from_hf(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {args.model}: {e}") from e


def _settings(args: argparse.Namespace, cfg: VisionConfig) -> EncodeSettings:
    settings = EncodeSettings(
        args.min_pixels,
        args.max_pixels,
        args.pixel_limit,
        args.batch_tokens,
        "return",
        decoder=args.decoder,
        video_min_pixels=args.video_min_pixels,
        video_max_pixels=args.video_max_pixels,
        fps=args.fps,
        num_frames=args.num_frames,
        image_processor_backend=args.image_processor_backend,
        workers=args.workers,
    )
    try:
        return settings.checked(cfg)
    except SettingError as e:  # named as options: "--min-pixels 0: must be from 1 to --max-pixels 16777216"
        option = (
            r"\b(video_min_pixels|video_max_pixels|min_pixels|max_pixels|pixel_limit|batch_tokens|fps|num_frames)\b(=?)"
        )
        accepted = re.sub(option, lambda m: f"--{m[1].replace('_', '-')}{' ' if m[2] else ''}", e.accepted)
        raise UsageError(f"--{e.setting.replace('_', '-')} {e.value}: {accepted}") from e


def _check_output(output: str) -> Path:
    """The output path, once a file could be created in its folder (a real probe: permissions and read-only file
    systems show here; a full disk shows only when the output is written, which keeps an earlier output)."""
    out = Path(output)
    try:
        if out.is_symlink():  # the file it names is replaced, and the link stays (as `vitjax convert` does)
            out = out.resolve()
        kind = "folder" if out.is_dir() else "file" if out.is_file() else "other" if out.exists() else None
    except (RuntimeError, OSError) as e:  # a loop of links (RuntimeError before Python 3.13), a name too long
        raise UsageError(f"-o {output}: {getattr(e, 'strerror', None) or e}") from e
    if kind == "folder":
        raise UsageError(f"-o {output}: is a directory")
    if os.path.basename(output) in ("", ".", ".."):  # "new/" or "new/.": Path would drop the ending, and write "new"
        raise UsageError(f"-o {output}: names a folder; give a file name")
    if kind == "other":  # a device or a FIFO would be replaced by the rename
        raise UsageError(f"-o {output}: exists and is not a regular file")
    folder = out.parent
    if not folder.is_dir():
        raise UsageError(f"-o {output}: folder {folder} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=TEMP_PREFIX, suffix=".probe"):
            pass
    except OSError as e:
        raise UsageError(f"-o {output}: cannot create files in {folder} ({e.strerror or e})") from e
    for suffix in (".tmp", ".probe"):  # those of runs killed (SIGKILL, out of memory) before they removed them
        remove_stale(folder, f"{TEMP_PREFIX}*{suffix}")
    return out


def _check_not_an_input(args: argparse.Namespace, out: Path, items: list[tuple[str, object]]) -> None:
    """Refuse an output that is one of the inputs (a folder's files included), the --files-from list or a file
    of --model: the rename would replace it."""
    try:
        written = out.stat()
    except OSError:  # no file yet: it is none of the inputs
        return
    named = [(f"the input {name}", source) for name, source in items]
    if args.files_from is not None:  # "-": whatever standard input (file descriptor 0) was redirected from
        named.append((f"--files-from {args.files_from}", 0 if args.files_from == "-" else args.files_from))
    if args.model:
        named += [(f"a file of --model {args.model}", p) for p in Path(args.model).rglob("*") if p.is_file()]
    for what, source in named:
        try:
            same = isinstance(source, (str, os.PathLike, int)) and os.path.samestat(os.stat(source), written)
        except (OSError, ValueError):  # missing or no path: reported as an input error
            continue
        if same:
            raise UsageError(f"-o {args.output}: is {what}; write the output elsewhere")


def _check_video_decoder(items: list[tuple[str, object]]) -> None:
    """Video files need PyAV: without it, say so before the model is built rather than fail each video."""
    if any(is_video_path(source) for _, source in items) and importlib.util.find_spec("av") is None:
        raise UsageError("video inputs need PyAV to decode them: pip install 'vitjax[video]'")


def _write_atomic(out: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """Write a temporary file beside `out`, flush it to disk, then rename it: `out` is whole or untouched.
    The file gets the permissions the user's umask gives new files: those it trims 0o666 to when the file is created
    (safetensors writes it 0o600; reading the umask means setting it, for every thread of the process)."""
    from safetensors.numpy import save_file

    tmp = out.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}.tmp"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mode = os.stat(tmp).st_mode & 0o777
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _encode(args: argparse.Namespace) -> int:
    started = time.perf_counter()

    def say(message: str) -> None:
        if not args.quiet:
            print(f"vitjax: {message}", file=sys.stderr)

    # Everything that can be wrong with the command line is found before the model is built.
    inputs = _inputs(args)
    cfg = _config(args)
    settings = _settings(args, cfg)
    out = _check_output(args.output)
    if args.decoder == "dali":
        from vitjax import dali

        if not dali.available():
            raise UsageError("--decoder dali needs NVIDIA DALI: pip install 'vitjax[dali]'")
    try:
        named = named_implementation(None)  # $VITJAX_ATTENTION, if set, names a path this install has
    except ValueError as e:
        raise UsageError(str(e)) from e
    try:
        named_implementation(None, args.dtype)  # ... for a tower of --dtype
    except ValueError as e:
        raise UsageError(f"--dtype {args.dtype}: {e}") from e
    try:
        policy = BucketPolicy(fit_granule=args.fit_granule)
    except ValueError as e:
        raise UsageError(f"--fit-granule {args.fit_granule}: must be 0 (off) or a multiple of 4") from e
    try:
        from vitjax.parallel import device_groups, pick_devices

        picked = pick_devices(args.devices)
        group = len(device_groups(picked, args.sequence_parallel, cfg.num_heads)[0])
    except ValueError as e:
        raise UsageError(f"--devices {args.devices} --sequence-parallel {args.sequence_parallel}: {e}") from e
    try:
        policy.check_group(group)
    except ValueError as e:
        raise UsageError(f"--fit-granule {args.fit_granule} --sequence-parallel {args.sequence_parallel}: {e}") from e
    try:
        check_devices(named, picked, f"${ENV_VAR}")
    except ValueError as e:
        raise UsageError(str(e)) from e
    items = expand_inputs(inputs)
    _check_not_an_input(args, out, items)
    _check_video_decoder(items)
    missing = {i: e for i, (name, source) in enumerate(items) if (e := path_error(name, source)) is not None}
    for error in missing.values():
        print(f"vitjax: error: {error}", file=sys.stderr)
    todo = [item for i, item in enumerate(items) if i not in missing]
    encoded, decoder, model_id = ([], args.decoder, "")
    if todo:
        encoded, decoder, model_id = _run_encoder(args, cfg, settings, policy, todo, say)
    encoded = iter(encoded)
    results = [missing[i] if i in missing else next(encoded) for i in range(len(items))]
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, ImageInputError)]
    images = [
        {"index": i, "source": r.name, "error": r.reason}
        if isinstance(r, ImageInputError)
        else {
            "index": i,
            "source": r.name,
            "grid_thw": list(r.grid_thw),
            "sha256": r.sha256,
            "decoder": r.decoder,
            "tokens": r.tokens,
        }
        for i, r in enumerate(results)
    ]
    written, write_error = len(results) - len(failed), None
    if written:
        from safetensors import SafetensorError

        meta = {
            "model": model_id if args.model else f"random-init:{args.random_init}:seed={args.seed}",
            "dtype": args.dtype,
            "vitjax_version": vitjax.__version__,
            "images": images,
            "min_pixels": settings.min_pixels,
            "max_pixels": settings.max_pixels,
            "decoder": decoder,
            "image_processor_backend": settings.image_processor_backend,
            "video_min_pixels": settings.video_min_pixels,
            "video_max_pixels": settings.video_max_pixels,
            "fps": FPS if settings.fps is None and settings.num_frames is None else settings.fps,  # what sampled
            "num_frames": settings.num_frames,
        }
        _check_stop_signals()
        try:
            _write_atomic(out, _tensors(results), {"vitjax": json.dumps(meta)})
        except (OSError, SafetensorError) as e:
            write_error = f"cannot write {out}: {getattr(e, 'strerror', None) or e}"
            print(f"vitjax: error: {write_error}; nothing was written", file=sys.stderr)
            written = 0
    tokens = sum(t["tokens"] for t in images if "tokens" in t) if written else 0
    if write_error is None:
        wrote = f"wrote {written} of {len(results)} images ({tokens} tokens, decoder {decoder}) to {out}"
        say(wrote if written else "nothing to write")
    if args.summary == "json":
        summary = {
            "output": str(out) if written else None,
            "written": written,
            "failed": [{"index": i, "source": r.name, "error": r.reason} for i, r in failed],
            "tokens": tokens,
            "decoder": decoder,
            "seconds": round(time.perf_counter() - started, 3),
        }
        if write_error:
            summary["error"] = write_error
        if (lost := _print_summary(summary)) is not None:
            print(f"vitjax: error: the summary was not printed: {lost}", file=sys.stderr)
            return 1
    return 0 if written == len(results) else 1


def _print_summary(summary: dict[str, object]) -> str | None:
    """Print the summary line on stdout; why it could not be printed, if it could not (the output is written all
    the same, so that is not a failed run: no traceback, no exit status 3)."""
    if sys.stdout is None:  # started with stdout closed (`>&-`): print() would drop the line without a word
        return "standard output is closed"
    try:
        print(json.dumps(summary), flush=True)
    except OSError as e:  # its reader left (`| head`: BrokenPipeError), or the device is full (`>/dev/full`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout again at exit
        return "standard output is closed" if isinstance(e, BrokenPipeError) else f"standard output: {e.strerror or e}"
    return None


class _Written:
    """One encoded image as the CLI keeps it: on the host, split as the file stores it."""

    def __init__(self, encoded, width: int):
        import numpy as np

        features = np.asarray(encoded.features)  # one device->host copy, split on the host
        self.name, self.grid_thw, self.sha256, self.decoder = (
            encoded.name,
            encoded.grid_thw,
            encoded.sha256,
            encoded.decoder,
        )
        self.tokens = len(features)
        self.embeds = np.ascontiguousarray(features[:, :width])
        self.deepstack = np.ascontiguousarray(features[:, width:].reshape(self.tokens, -1, width).transpose(1, 0, 2))


def _run_encoder(
    args, cfg: VisionConfig, settings: EncodeSettings, policy: BucketPolicy, items: list, say
) -> tuple[list, str, str]:
    """Build the encoder (the slow part) and encode `items`: per item an `ImageInputError` or a `_Written`; the
    decoder that `--decoder` resolved to; and the model's folder (a hub model's snapshot in the cache)."""
    from vitjax.weights import CheckpointError

    parallel = {"devices": args.devices, "sequence_parallel": args.sequence_parallel, "buckets": policy}
    try:
        folder = model_folder(args.model, progress=not args.quiet) if args.model else None  # a hub model's weights
    except OSError as e:  # the hub did not give them (the message names the model)
        raise UsageError(f"--model {e}") from e
    except CheckpointError as e:  # it gave an index that is none
        raise UsageError(f"--model {args.model}: {e}") from e
    try:
        if folder:
            enc = vitjax.Encoder.from_pretrained(folder, dtype=args.dtype, progress=not args.quiet, **parallel)
        else:
            enc = vitjax.Encoder.random(cfg, seed=args.seed, dtype=args.dtype, **parallel)
            say(f"using RANDOM weights ({args.random_init}, seed {args.seed}): embeddings are meaningless")
    except (CheckpointError, OSError) as e:
        raise UsageError(f"--model {args.model}: {e}") from e
    from tqdm.auto import tqdm

    decoder = enc.resolve_decoder(settings.decoder)
    sources = [source for _, source in items]  # paths, named by themselves
    options = dict(
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
        pixel_limit=settings.pixel_limit,
        batch_tokens=settings.batch_tokens,
        errors="return",
        decoder=decoder,
        video_min_pixels=settings.video_min_pixels,
        video_max_pixels=settings.video_max_pixels,
        fps=settings.fps,
        num_frames=settings.num_frames,
        image_processor_backend=settings.image_processor_backend,
        workers=settings.workers,
    )
    videos = any(is_video_path(source) for source in sources)
    tokens = settings.largest_patches(cfg, videos, settings.num_frames or MAX_FRAMES) // cfg.merge_unit
    size = max(1, CHUNK_BYTES // (tokens * cfg.output_width * (4 if args.dtype == "float32" else 2)))
    results, held = [], []
    with tqdm(total=len(sources), desc="encoding", unit="input", disable=args.quiet) as bar:
        for start in range(0, len(sources) + size, size):
            _check_stop_signals()
            chunk = enc.encode(sources[start : start + size], progress=bar, **options) if start < len(sources) else []
            for res in held:  # the chunk before, to the host once this one is dispatched
                if isinstance(res, ImageInputError):
                    print(f"vitjax: error: {res}", file=sys.stderr)
                    results.append(res)
                else:
                    results.append(_Written(res, cfg.out_hidden_size))
            held = chunk
    return results, decoder, str(folder.resolve()) if folder else ""


def _tensors(results: list) -> dict:
    """The file's tensors: `{i}.embeds` and `{i}.deepstack` for every input `i` that was encoded."""
    tensors = {}
    for i, res in enumerate(results):
        if isinstance(res, _Written):
            tensors[f"{i}.embeds"], tensors[f"{i}.deepstack"] = res.embeds, res.deepstack
    return tensors


def _convert(args: argparse.Namespace) -> int:
    from vitjax.weights import convert

    try:
        out = convert(args.hf_dir, args.out_dir, progress=not args.quiet)
    except (ValueError, OSError) as e:  # a CheckpointError, a config that is not Qwen3-VL's, a folder it cannot use
        raise UsageError(f"convert {args.hf_dir} {args.out_dir}: {e}") from e
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitjax",
        description=__doc__,
        epilog=f"{EPILOG}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {vitjax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser(
        "encode",
        help="encode images and videos with the Qwen3-VL vision tower into a safetensors file",
        description="Encode images and videos with the Qwen3-VL vision tower into a safetensors file. Videos "
        "(files with a video extension, also in folders) are sampled and resized as HF's Qwen3VLVideoProcessor "
        "does; their grid_thw has t = one per pair of sampled frames.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    enc.add_argument("--version", action="version", version=f"vitjax {vitjax.__version__}")
    enc.add_argument("inputs", nargs="*", help="image or video files, or folders (searched recursively)")
    enc.add_argument(
        "--files-from", metavar="FILE", help="read more inputs from FILE, one per line ('-': standard input)"
    )
    weights = enc.add_mutually_exclusive_group(required=True)
    weights.add_argument(
        "--model", help="HF checkpoint directory, a directory written by `vitjax convert`, or a Hugging Face Hub id"
    )
    weights.add_argument(
        "--random-init",
        metavar="PRESET",
        help=f"random weights of a preset: {', '.join(PRESETS)} (embeddings are meaningless)",
    )
    enc.add_argument("-o", "--output", required=True, help="output .safetensors file (written atomically)")
    enc.add_argument("--min-pixels", type=int, default=MIN_PIXELS, help="smallest resized area (default: %(default)s)")
    enc.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="largest resized area (default: %(default)s)")
    enc.add_argument(
        "--pixel-limit",
        type=int,
        default=PIXEL_LIMIT,
        help="the most --max-pixels may be; raise it deliberately for larger images (default: %(default)s)",
    )
    enc.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="the tower's and the embeddings' dtype (default: %(default)s)",
    )
    enc.add_argument(
        "--batch-tokens",
        type=int,
        help=f"patches per tower call; a larger image or video is a call of its own (default: {BATCH_TOKENS})",
    )
    enc.add_argument(
        "--workers",
        type=int,
        help="threads that decode and preprocess the inputs (default: one a core, up to 16)",
    )
    enc.add_argument(
        "--devices",
        type=_device_count,
        default=1,
        help="devices to spread the images over, a count or 'all' (default: %(default)s)",
    )
    enc.add_argument(
        "--sequence-parallel",
        type=int,
        default=1,
        metavar="N",
        help="groups of N devices share each call's tokens (Ulysses); N divides --devices (default: %(default)s)",
    )
    enc.add_argument(
        "--fit-granule",
        type=int,
        default=FIT_GRANULE,
        metavar="N",
        help="a call size seen twice moves to a bucket of its tokens rounded up to N, compiled in the background "
        "(fewer padded rows); 0 keeps every call on the bucket ladder (default: %(default)s)",
    )
    enc.add_argument(
        "--decoder",
        choices=DECODERS,
        default="auto",
        help="pil: HF-exact on the CPU; dali: NVIDIA DALI (nvJPEG on a GPU); auto: dali on a GPU when DALI is "
        "installed, else pil (default: %(default)s)",
    )
    enc.add_argument(
        "--image-processor-backend",
        choices=IMAGE_PROCESSOR_BACKENDS,
        default="pil",
        help="the HF image processor whose pixel rows images get: pil (Qwen2VLImageProcessorPil) or torchvision "
        "(Qwen2VLImageProcessor, what AutoProcessor builds by default) (default: %(default)s)",
    )
    video = enc.add_argument_group("videos (decoded with PyAV: pip install 'vitjax[video]')")
    video.add_argument(
        "--fps", type=float, help="frames sampled per second of video (default: 2; excludes --num-frames)"
    )
    video.add_argument("--num-frames", type=int, help="frames sampled per video, evenly spaced (excludes --fps)")
    video.add_argument(
        "--video-min-pixels",
        type=int,
        default=VIDEO_MIN_PIXELS,
        help="smallest resized area of a video, all frames together; each frame's budget is at least 1.05x this "
        "(HF's per-frame cap; default: %(default)s)",
    )
    video.add_argument(
        "--video-max-pixels",
        type=int,
        default=VIDEO_MAX_PIXELS,
        help="budget of a video's resized area, shared evenly by its frames, each share at least 1.05x "
        "--video-min-pixels (HF's per-frame cap; default: %(default)s)",
    )
    enc.add_argument("--seed", type=_seed, default=0, help="seed for --random-init (default: %(default)s)")
    enc.add_argument(
        "--summary",
        choices=("json",),
        help="print one JSON object on stdout: output, written, failed (index, source, error), tokens, decoder, "
        "seconds",
    )
    enc.add_argument("-q", "--quiet", action="store_true", help="no progress bar or notes; errors still go to stderr")
    enc.set_defaults(func=_encode)

    conv = sub.add_parser("convert", help="convert an HF checkpoint's vision tower to vitjax's orbax format")
    conv.add_argument("hf_dir", help="HF model directory (config.json + *.safetensors) or a Hugging Face Hub id")
    conv.add_argument("out_dir", help="output directory")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse's own errors and --help/--version included)."""
    # A signal handler can only be set from the main thread; elsewhere the signals keep theirs.
    handler = threading.current_thread() is threading.main_thread()
    stops = [s for s in STOP_SIGNALS if handler and signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, _on_stop_signal) for s in stops}
    _stop_signals.clear()
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        _check_stop_signals()
        return status
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    except UsageError as e:
        print(f"vitjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outputs are written whole or not at all (no traceback to show)
        print("vitjax: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"vitjax: {'hung up' if e.signum == signal.SIGHUP else 'terminated'}", file=sys.stderr)
        return 128 + e.signum
    except Exception:  # not an input's fault, so not status 1: the machine's (memory) or ours
        traceback.print_exc()
        print("vitjax: error: the run failed (above); nothing was written", file=sys.stderr)
        return 3
    finally:
        for s, before in previous.items():  # None: a handler not set from Python, which cannot be put back
            signal.signal(s, signal.SIG_DFL if before is None else before)


if __name__ == "__main__":
    sys.exit(main())
