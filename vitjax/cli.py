"""`vitjax` command line: `vitjax convert HF_DIR OUT_DIR` (and `vitjax encode`, see below)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _convert(args: argparse.Namespace) -> int:
    from vitjax.weights import convert

    out = convert(args.hf_dir, args.out_dir, progress=not args.quiet)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
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
