"""Images in, pixel rows out, on the CPU: `preprocess_image` with each backend beside HF's two image processors.

Per photo (the shipped ones, and a 4032x3024 phone-sized JPEG made from one of them), end to end from the file:
vitjax `preprocess_image(path, backend=...)` for "pil" and "torchvision" (PyTorch's resize kernel where installed, and
again with the numpy repetition forced, the path without PyTorch); HF's `Qwen2VLImageProcessorPil` and
`Qwen2VLImageProcessor` (torchvision) given `transformers.image_utils.load_image(path)`, as a user holding a path
gives them. Each backend's rows are checked equal to its HF processor's, bit for bit. Times are medians.

    PYTHONPATH=. python bench/bench_image_processor.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from bench_vit import median_time
from cpu_bench import cpu_meta, numpy_resize, save_rows  # bench/ is on sys.path when run as a script
from PIL import Image

from vitjax.preprocess import preprocess_image

PHOTOS = sorted((Path(__file__).resolve().parents[1] / "tests" / "data" / "images").glob("*.[jp][pn]g"))


def hf_processor(backend: str):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    cls = Qwen2VLImageProcessorPil if backend == "pil" else Qwen2VLImageProcessor
    return cls(  # Qwen3-VL's preprocessor_config.json
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )


def numpy_only(path: Path) -> np.ndarray:
    with numpy_resize():
        return preprocess_image(path, backend="torchvision")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default=f"cpu ({os.cpu_count()} cores)", help="the machine, in words")
    args = parser.parse_args()

    from transformers.image_utils import load_image

    meta = cpu_meta(args.device, ("numpy", "pillow", "torch", "torchvision", "transformers"))
    hf = {backend: hf_processor(backend) for backend in ("pil", "torchvision")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        phone = Path(tmp) / "phone-4032x3024.jpg"
        Image.open(PHOTOS[0]).convert("RGB").resize((4032, 3024), Image.Resampling.BICUBIC).save(phone, quality=90)
        for path in [*PHOTOS, phone]:
            with Image.open(path) as image:
                size = f"{image.width}x{image.height}"
            runs = []
            for backend, processor in hf.items():
                ours = preprocess_image(path, backend=backend)[0]
                ref = processor(images=load_image(str(path)), return_tensors="np")["pixel_values"]
                assert np.array_equal(ours, ref), (path.name, backend)
                runs.append(("hf", backend, lambda p=processor, path=path: p(images=load_image(str(path)))))
                runs.append(("vitjax", backend, lambda b=backend, path=path: preprocess_image(path, backend=b)))
            assert np.array_equal(numpy_only(path), preprocess_image(path, backend="torchvision")[0])
            runs.append(("vitjax_numpy_resize", "torchvision", lambda path=path: numpy_only(path)))
            for impl, backend, fn in runs:
                seconds, times = median_time(fn, args.reps)
                row = {**meta, "script": "bench_image_processor", "workload": f"{path.name} {size}"}
                row.update(impl=impl, backend=backend, ms=seconds * 1e3, ms_all=[round(t * 1e3, 1) for t in times])
                rows.append(row)
                print(json.dumps(row), flush=True)
    save_rows(rows, args.out, "image-processor", {"workload": 36, "impl": 19, "backend": 11})


if __name__ == "__main__":
    main()
