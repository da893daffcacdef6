"""`vitjax` command line: encode images to a safetensors file, or convert an HF checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from vitjax.encoder import BATCH_TOKENS
from vitjax.pipeline import DECODERS
from vitjax.preprocess import MAX_PIXELS, MIN_PIXELS

EPILOG = """examples:
  vitjax encode photos/ --random-init qwen3-vl-2b -o embeds.safetensors
  vitjax encode a.jpg b.png --model checkpoints/qwen3-vl-8b -o embeds.safetensors
  vitjax convert /path/to/Qwen3-VL-8B-Instruct checkpoints/qwen3-vl-8b"""


def _encode(args: argparse.Namespace) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    import vitjax
    import vitjax.dali
    from vitjax.images import ImageInputError

    if args.decoder == "dali" and not vitjax.dali.available():
        print("vitjax: error: --decoder dali needs NVIDIA DALI: pip install 'vitjax[dali]'", file=sys.stderr)
        return 2
    parallel = {"devices": args.devices, "sequence_parallel": args.sequence_parallel}
    if args.model:
        enc = vitjax.Encoder.from_pretrained(args.model, dtype=args.dtype, progress=True, **parallel)
        model = args.model
    else:
        enc = vitjax.Encoder.random(args.random_init, seed=args.seed, dtype=args.dtype, **parallel)
        model = f"random-init:{args.random_init}:seed={args.seed}"
        print(
            f"vitjax: using RANDOM weights ({args.random_init}, seed {args.seed}): embeddings are meaningless",
            file=sys.stderr,
        )
    decoder = enc.resolve_decoder(args.decoder)
    results = enc.encode(
        args.inputs,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        batch_tokens=args.batch_tokens,
        errors="return",
        progress=True,
        decoder=decoder,
    )
    tensors, images, failed = {}, [], 0
    width = enc.cfg.out_hidden_size
    for i, res in enumerate(results):
        name = res.name
        if isinstance(res, ImageInputError):
            failed += 1
            print(f"vitjax: error: {res}", file=sys.stderr)
            images.append({"index": i, "source": name, "error": res.reason})
            continue
        features = np.asarray(res.features)  # one device->host copy, split on the host
        tensors[f"{i}.embeds"] = np.ascontiguousarray(features[:, :width])
        tensors[f"{i}.deepstack"] = np.ascontiguousarray(
            features[:, width:].reshape(len(features), -1, width).transpose(1, 0, 2)
        )
        images.append(
            {
                "index": i,
                "source": name,
                "grid_thw": list(res.grid_thw),
                "sha256": res.sha256,
                "decoder": res.decoder,
                "tokens": len(features),
            }
        )
    meta = {
        "model": model,
        "dtype": args.dtype,
        "vitjax_version": vitjax.__version__,
        "images": images,
        "min_pixels": args.min_pixels,
        "max_pixels": args.max_pixels,
        "decoder": decoder,
    }
    save_file(tensors, args.output, metadata={"vitjax": json.dumps(meta)})
    done = len(results) - failed
    tokens = sum(int(np.prod(t.shape[:-1])) for k, t in tensors.items() if k.endswith(".embeds"))
    summary = f"vitjax: wrote {done} of {len(results)} images ({tokens} tokens, decoder {decoder}) to {args.output}"
    print(summary, file=sys.stderr)
    return 1 if failed or not results else 0


def _convert(args: argparse.Namespace) -> int:
    from vitjax.weights import convert

    out = convert(args.hf_dir, args.out_dir, progress=not args.quiet)
    print(f"wrote {out}")
    return 0


def _device_count(text: str) -> int | str:
    if text == "all":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive count or 'all', got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitjax", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="encode images with the Qwen3-VL vision tower into a safetensors file")
    enc.add_argument("inputs", nargs="+", help="image files or directories (searched recursively)")
    weights = enc.add_mutually_exclusive_group(required=True)
    weights.add_argument("--model", help="HF checkpoint directory or a directory written by `vitjax convert`")
    weights.add_argument("--random-init", metavar="PRESET", help="random weights of a preset, e.g. qwen3-vl-2b")
    enc.add_argument("-o", "--output", required=True, help="output .safetensors file")
    enc.add_argument("--min-pixels", type=int, default=MIN_PIXELS, help="smallest resized area (default: %(default)s)")
    enc.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="largest resized area (default: %(default)s)")
    enc.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="(default: %(default)s)")
    enc.add_argument(
        "--batch-tokens", type=int, default=BATCH_TOKENS, help="patches per tower call (default: %(default)s)"
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
        "--decoder",
        choices=DECODERS,
        default="auto",
        help="pil: HF-exact on the CPU; dali: NVIDIA DALI (nvJPEG on a GPU); auto: dali on a GPU when DALI is "
        "installed, else pil (default: %(default)s)",
    )
    enc.add_argument("--seed", type=int, default=0, help="seed for --random-init (default: %(default)s)")
    enc.set_defaults(func=_encode)

    conv = sub.add_parser("convert", help="convert an HF checkpoint's vision tower to vitjax's orbax format")
    conv.add_argument("hf_dir", help="HF model directory (config.json + *.safetensors)")
    conv.add_argument("out_dir", help="output directory")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
