"""Convert an HF Qwen3-VL checkpoint's vision tower to vitjax's orbax format.

Usage: python checkpoints/convert_hf.py HF_DIR OUT_DIR
"""

import sys

from vitjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
