"""decoder="dali" (NVIDIA DALI's CPU backend here) against the exact PIL path: rows, tower outputs, routing, bad input.

What may differ, and the tolerances held: DALI's JPEG decode on the CPU is libjpeg-turbo, bit-identical to PIL's
(tested), and rescale/normalize is the same 256-entry table, so only the resize differs. DALI runs Pillow's two
one-axis passes in Pillow's order with uint8 between them, but filters in float where Pillow uses 22-bit fixed
point (at most 1 level apart inside the image) and clamps at the borders where Pillow renormalizes the cut kernel
(a few levels in the outer 2-3 pixels). Hence per image: max |rows| difference <= 6 levels (0.047 after
normalization; measured 5), mean <= 0.25 level (0.002; measured <= 0.011 level on photos, 0.23 on a 7x5 image
upscaled 45x, which is all border); fp32 tower outputs' cosine similarity >= 0.9999 (measured >= 0.999997 on
photos, 0.99996 on the 7x5 image). A high-contrast border (a 1-pixel black frame on white, shrunk) is the one
exception measured: up to 22 levels there, mean <= 0.3 level, cosine still >= 0.9999. With
image_processor_backend="torchvision" DALI resizes width first (PyTorch's order) and normalizes by that processor's
table, against whose rows the same bounds hold.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, assert_close_to_scale, hf_vision_model
from PIL import Image
from safetensors import safe_open

pytest.importorskip("nvidia.dali")

import vitjax  # noqa: E402
from vitjax.cli import main as cli_main  # noqa: E402
from vitjax.dali import DaliRows, first_pass  # noqa: E402
from vitjax.images import ImageInputError  # noqa: E402
from vitjax.pipeline import Pipeline, jpeg_process  # noqa: E402
from vitjax.preprocess import MAX_PIXELS, MIN_PIXELS, preprocess_image  # noqa: E402

PHOTOS = sorted((Path(__file__).parent / "data" / "images").glob("*.[jp][pn]g"))
SMALL = 128 * 128 * 4  # keeps the CPU tower small
LEVEL = 2 / 255  # one uint8 level after normalization


def jpeg(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=92, **kw)
    return buf.getvalue()


def cases() -> dict[str, bytes]:
    """Every shipped photograph, and JPEGs of odd, tiny, 200:1, 1:200 and EXIF-rotated sizes, and a grey one."""
    photo = Image.open(PHOTOS[2]).convert("RGB")  # chelsea, 451x300
    rotated = Image.Exif()
    rotated[0x0112] = 6  # stored sideways: decoded 300 wide, 451 high
    return {
        **{p.name: p.read_bytes() for p in PHOTOS},
        "odd-517x333.jpg": jpeg(photo.resize((517, 333))),
        "tiny-7x5.jpg": jpeg(photo.resize((7, 5))),
        "wide-6400x32.jpg": jpeg(photo.resize((6400, 32))),
        "tall-32x6400.jpg": jpeg(photo.resize((32, 6400))),
        "exif6-451x300.jpg": jpeg(photo, exif=rotated.tobytes()),
        "grey-451x300.jpg": jpeg(photo.convert("L")),
    }


CASES = cases()


@pytest.fixture(scope="module")
def rows():
    return DaliRows(vitjax.VisionConfig.preset("qwen3-vl-2b"))


@pytest.fixture(scope="module")
def enc():
    return vitjax.Encoder.random(TINY["hd64"], dtype="float32", cache_bytes=0)


def dali_rows(
    rows: DaliRows, inputs: dict[str, object], max_pixels: int, backend: str = "pil"
) -> tuple[list, np.ndarray, list]:
    options = {"min_pixels": MIN_PIXELS, "max_pixels": max_pixels, "pixel_dtype": np.float32, "dali": rows}
    with Pipeline(rows.cfg, **options, image_processor_backend=backend) as pipe:
        items = list(pipe.prepare(list(inputs.items())))
        pixels, errors = pipe.fill(items)
    return items, pixels, errors


def test_first_pass_is_pillows_order():
    """Pillow's result equals one of its two pass orders; `first_pass` names the one it takes."""
    rng = np.random.default_rng(0)
    decided = 0
    for _ in range(150):
        width, height = rng.integers(8, 120, 2)
        out_w, out_h = rng.integers(4, 240, 2)
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        direct = np.asarray(image.resize((out_w, out_h), Image.Resampling.BICUBIC))
        h1, w1 = first_pass((height, width), (out_h, out_w))
        two = image.resize((w1, h1), Image.Resampling.BICUBIC).resize((out_w, out_h), Image.Resampling.BICUBIC)
        np.testing.assert_array_equal(np.asarray(two), direct, err_msg=f"{width}x{height} -> {out_w}x{out_h}")
        decided += (h1, w1) not in ((height, width), (out_h, out_w))
    assert decided > 100  # most cases resize both axes, so the order is really tested


def test_first_pass_is_pytorchs_order_for_the_torchvision_backend():
    """PyTorch resizes the width first whatever the sizes (`vitjax.resize`, tested against torchvision), also where
    Pillow 13 would shrink the height first."""
    assert first_pass((3000, 100), (32, 96), "torchvision") == (3000, 96)
    assert first_pass((100, 3000), (96, 32), "torchvision") == (100, 32)


@pytest.mark.parametrize(("max_pixels", "backend"), [(MAX_PIXELS, "pil"), (SMALL, "pil"), (SMALL, "torchvision")])
def test_rows_match_the_cpu_rows(rows, max_pixels, backend):
    items, pixels, errors = dali_rows(rows, CASES, max_pixels, backend)
    assert errors == [None] * len(CASES)
    start = 0
    for (name, data), item in zip(CASES.items(), items, strict=True):
        got = pixels[start : start + item.tokens]
        start += item.tokens
        ref, grid = preprocess_image(data, MIN_PIXELS, max_pixels, backend=backend)
        assert item.grid == tuple(grid[0]), name
        diff = np.abs(got - ref)
        if name.endswith(".png"):  # routed to PIL: its pixels pass through DALI untouched
            assert item.decoder == "pil"
            np.testing.assert_array_equal(got, ref)
        else:
            assert item.decoder == "dali", name
            assert diff.max() <= 6 * LEVEL and diff.mean() <= 0.25 * LEVEL, (name, diff.max(), diff.mean())


def test_high_contrast_borders_stay_within_their_own_bound(rows, enc):
    """A 1-pixel black frame on white, shrunk: DALI clamps the kernel at the border where Pillow renormalizes it,
    so the outer rows differ most there (22 levels measured on 1000x700 at 65,536 pixels; 9 on 150x100), still
    nowhere near a different image: a tiny fp32 tower's cosine to the PIL path >= 0.9999."""
    inputs = {}
    for width, height in ((1000, 700), (150, 100)):
        framed = np.full((height, width, 3), 255, np.uint8)
        framed[[0, -1]], framed[:, [0, -1]] = 0, 0
        inputs[f"{width}x{height}"] = jpeg(Image.fromarray(framed))
    items, pixels, _ = dali_rows(rows, inputs, 65536)
    ref = np.concatenate([preprocess_image(data, MIN_PIXELS, 65536)[0] for data in inputs.values()])
    diff = np.abs(pixels - ref) / LEVEL
    assert [item.decoder for item in items] == ["dali", "dali"] and 6 < diff.max() <= 24 and diff.mean() <= 0.3
    pil, dali = (enc.encode(list(inputs.values()), max_pixels=65536, decoder=d) for d in ("pil", "dali"))
    for a, b in zip(pil, dali, strict=True):
        x, y = np.asarray(a.features, np.float64), np.asarray(b.features, np.float64)
        assert (x * y).sum() / np.linalg.norm(x) / np.linalg.norm(y) >= 0.9999


def test_dali_decode_is_pils(rows):
    """Rows at the decoded size (no resize) are bit-identical: decode, EXIF orientation, grey, table, patchify."""
    photo = Image.open(PHOTOS[2]).convert("RGB").crop((0, 0, 448, 288))
    inputs = {f"exif{k}.jpg": jpeg(photo, exif=_orientation(k)) for k in range(1, 9)}
    inputs["exif6-big-endian.jpg"] = jpeg(photo, exif=orientation_exif(6, 3, "MM"))  # a SHORT either way: DALI's
    late = orientation_exif(1, 3, "II")  # an EXIF block after the scan: PIL and DALI both read the one before it
    inputs["exif6-then-1-after-the-scan.jpg"] = (
        jpeg(photo, exif=_orientation(6))[:-2] + b"\xff\xe1" + (len(late) + 2).to_bytes(2, "big") + late + b"\xff\xd9"
    )
    inputs["progressive.jpg"] = jpeg(photo, progressive=True)
    inputs["grey.jpg"] = jpeg(photo.convert("L"))
    inputs["444.jpg"] = jpeg(photo, subsampling=0)
    items, pixels, _ = dali_rows(rows, inputs, MAX_PIXELS)
    ref = np.concatenate([preprocess_image(data)[0] for data in inputs.values()])
    assert [item.decoder for item in items] == ["dali"] * len(inputs)
    np.testing.assert_array_equal(pixels, ref)


def _orientation(k: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = k
    return exif.tobytes()


def test_tower_outputs_match_pil(enc):
    inputs = list(CASES.values())
    pil = enc.encode(inputs, max_pixels=SMALL, decoder="pil")
    dali = enc.encode(inputs, max_pixels=SMALL, decoder="dali")
    for name, a, b in zip(CASES, pil, dali, strict=True):
        assert a.grid_thw == b.grid_thw and a.decoder == "pil", name
        assert b.decoder == ("pil" if name.endswith(".png") else "dali"), name
        x, y = np.asarray(a.features, np.float64), np.asarray(b.features, np.float64)
        cosine = (x * y).sum() / np.linalg.norm(x) / np.linalg.norm(y)
        assert cosine >= 0.9999, (name, cosine)


XMP_ORIENTATION_6 = (
    b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
    b'<rdf:Description rdf:about="" xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/>'
    b"</rdf:RDF></x:xmpmeta>"
)
# EXIF (little-endian TIFF) with one IFD0 entry: Orientation (0x0112), type BYTE (1), count 1, value 6.
BYTE_ORIENTATION_6 = (
    b"Exif\x00\x00II*\x00\x08\x00\x00\x00"  # header, IFD0 at offset 8
    b"\x01\x00\x12\x01\x01\x00\x01\x00\x00\x00\x06\x00\x00\x00\x00\x00\x00\x00"  # one entry, no next IFD
)


def orientation_exif(value: int, kind: int, order: str) -> bytes:
    """An EXIF block whose one IFD0 entry is Orientation `value`, of TIFF type `kind` (3 SHORT, 4 LONG), in byte
    `order` ("II" or "MM")."""
    little = order == "II"
    end = "little" if little else "big"
    field = value.to_bytes(2 if kind == 3 else 4, end).ljust(4, b"\x00")
    entry = (0x0112).to_bytes(2, end) + kind.to_bytes(2, end) + (1).to_bytes(4, end) + field
    header = b"II*\x00" if little else b"MM\x00*"
    return b"Exif\x00\x00" + header + (8).to_bytes(4, end) + (1).to_bytes(2, end) + entry + bytes(4)


def two_exif_blocks(image: Image.Image, first: int, second: int) -> bytes:
    """A JPEG with two EXIF segments: PIL (and HF) read the first, DALI the last."""
    data = jpeg(image, exif=orientation_exif(first, 3, "II"))
    at = data.index(b"\xff\xe1")
    end = at + 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    block = orientation_exif(second, 3, "II")
    return data[:end] + b"\xff\xe1" + (len(block) + 2).to_bytes(2, "big") + block + data[end:]


def test_jpeg_process_reads_the_frame_and_refuses_stray_markers():
    """The start-of-frame marker DALI's routing reads, walking every segment and scan of the file."""
    photo = Image.open(PHOTOS[2]).convert("RGB")
    assert {jpeg_process(jpeg(photo)), jpeg_process(jpeg(photo, progressive=True))} == {0xC0, 0xC2}
    assert jpeg_process(jpeg(photo, restart_marker_blocks=1)) == 0xC0  # restarts in the scan data
    good = jpeg(photo)
    sof = good.index(b"\xff\xc0")
    assert jpeg_process(good[: sof + 1] + b"\xc3" + good[sof + 2 :]) == 0xC3  # lossless: PIL's, DALI refuses
    scan = good.index(b"\xff\xda")
    assert jpeg_process(good[: scan + 3000] + b"\xff\xc8" + good[scan + 3002 :]) is None
    assert jpeg_process(good[:-100] + b"\xff\xd9") == 0xC0  # a cut scan: both decoders fill it the same way
    assert jpeg_process(good[2:]) is None and jpeg_process(good + good) is None


def test_corrupt_jpegs_pil_refuses_are_refused_and_dali_keeps_working(enc):
    """A stray marker in the scan data: PIL (HF's loader) refuses the file, and so does decoder="dali" (DALI
    decoded garbage from it without an error). Files DALI refuses, round after round: DALI's pipeline used to
    grow 4x per refusal until, on the 15th, no DALI call worked again."""
    good = jpeg(Image.open(PHOTOS[2]).convert("RGB"))
    scan = good.index(b"\xff\xda")
    stray = good[: scan + 3000] + b"\xff\xc8" + good[scan + 3002 :]
    huffman = good.index(b"\xff\xc4") + 5
    bogus = good[:huffman] + b"\xff" * 16 + good[huffman + 16 :]
    (pil,) = enc.encode([stray], max_pixels=SMALL, decoder="pil", errors="return")
    assert isinstance(pil, ImageInputError) and "broken data stream" in pil.reason
    for _ in range(16):
        results = enc.encode([stray, good, bogus], max_pixels=SMALL, decoder="dali", errors="return")
        assert [type(r).__name__ for r in results] == ["ImageInputError", "Encoded", "ImageInputError"]
        assert results[0].reason == pil.reason and results[1].decoder == "dali"
        assert results[2].reason == "corrupt JPEG data (DALI's decoder refused it)"


def test_routing(tmp_path):
    """DALI gets complete RGB/grey JPEGs; PIL keeps CMYK, other formats and pixels; each item says which."""
    photo = Image.open(PHOTOS[2]).convert("RGB")
    png = io.BytesIO()
    photo.save(png, "PNG")
    inputs = {
        "rgb": jpeg(photo),
        "cmyk": jpeg(photo.convert("CMYK")),
        "png": png.getvalue(),
        "pil": photo,
        "array": np.asarray(photo),
        "trailing": jpeg(photo) + b"appended data",  # no end-of-image marker at the end: PIL decides
        # Orientation 6 in XMP only: PIL and HF turn the image, DALI (EXIF only) would not. A BYTE-typed EXIF
        # orientation: PIL does not turn it, DALI would. Both used to go to DALI with wrong pixels (cosine 0.89).
        "xmp": jpeg(photo, xmp=XMP_ORIENTATION_6),
        "byte": jpeg(photo, exif=BYTE_ORIENTATION_6),
        # An EXIF block that is not TIFF: PIL (and HF) decode the image and ignore it; the routing used to raise.
        "garbled-exif": jpeg(photo, exif=b"Exif\x00\x00" + bytes(range(7, 47))),
        # DALI reads a big-endian LONG orientation as 0 (no turn) and the last of two EXIF blocks, PIL the first:
        # both used to go to DALI unturned, their rows scrambled into PIL's grid (cosine 0.32).
        "long-mm": jpeg(photo, exif=orientation_exif(6, 4, "MM")),
        "two-exif-6-1": two_exif_blocks(photo, 6, 1),
        "two-exif-1-6": two_exif_blocks(photo, 1, 6),
    }
    cfg = vitjax.VisionConfig.preset("qwen3-vl-2b")
    with Pipeline(cfg, min_pixels=MIN_PIXELS, max_pixels=SMALL, pixel_dtype=np.float32, dali=DaliRows(cfg)) as pipe:
        items = list(pipe.prepare(list(inputs.items())))
    assert [item.decoder for item in items] == ["dali"] + ["pil"] * 11
    assert items[6].grid[1] > items[6].grid[2] and items[7].grid[1] < items[7].grid[2]  # PIL's turn, and not
    assert items[9].grid == items[10].grid == items[6].grid and items[11].grid == items[0].grid  # as PIL turns them
    assert items[8].grid == items[3].grid  # the garbled EXIF's image, upright as the photo
    assert items[0].digest != items[3].digest  # DALI hashes the file, PIL the pixels: never the same cache entry


def bad_inputs(tmp_path: Path) -> dict[str, str]:
    """Files that must each come back as their own error: path -> a fragment of the reason."""
    good = jpeg(Image.open(PHOTOS[2]).convert("RGB"))
    (tmp_path / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_bytes(b"not an image at all")
    # PIL reads its header, but every Huffman table is bogus: DALI refuses the whole batch, so it is found alone.
    huffman = good.index(b"\xff\xc4") + 5
    bogus = good[:huffman] + b"\xff" * 16 + good[huffman + 16 :]
    (tmp_path / "bogus-huffman.jpg").write_bytes(bogus)
    return {
        str(tmp_path / "truncated.jpg"): "truncated",
        str(tmp_path / "empty.jpg"): "empty input",
        str(tmp_path / "text.jpg"): "not a recognised image format",
        str(tmp_path / "bogus-huffman.jpg"): "corrupt JPEG data (DALI's decoder refused it)",
    }


def test_bad_inputs_are_named_and_the_rest_equal_encoding_alone(enc, tmp_path):
    bad = bad_inputs(tmp_path)
    good = [str(PHOTOS[0]), str(PHOTOS[1]), str(PHOTOS[3])]  # a JPEG, a PNG, a JPEG
    inputs = [good[0], *list(bad)[:2], good[1], *list(bad)[2:], good[2]]
    results = enc.encode(inputs, max_pixels=SMALL, decoder="dali", errors="return")
    for name, result in zip(inputs, results, strict=True):
        if name in bad:
            assert isinstance(result, ImageInputError) and result.name == name, result
            assert bad[name] in result.reason, result.reason
            continue
        assert result.decoder == ("pil" if name.endswith(".png") else "dali")
        (alone,) = enc.encode([name], max_pixels=SMALL, decoder="dali")
        assert_close_to_scale(np.asarray(result.features), np.asarray(alone.features))


def test_duplicates_once_and_cache_keys_name_the_decoder():
    enc = vitjax.Encoder.random(TINY["hd64"], dtype="float32")
    photo = PHOTOS[0]  # a JPEG
    first = enc.encode([str(photo), photo.read_bytes(), str(photo)], max_pixels=SMALL, decoder="dali")
    assert enc.images_encoded == 1 and first[0].features is first[1].features is first[2].features
    (pil,) = enc.encode([str(photo)], max_pixels=SMALL, decoder="pil")  # other pixels: another entry
    assert enc.images_encoded == 2 and pil.sha256 != first[0].sha256
    (again,) = enc.encode([photo.read_bytes()], max_pixels=SMALL, decoder="dali")
    assert enc.images_encoded == 2 and np.array_equal(np.asarray(again.features), np.asarray(first[0].features))


def test_several_devices_equal_one(enc):
    inputs = [str(p) for p in PHOTOS]
    two = vitjax.Encoder.random(TINY["hd64"], dtype="float32", devices=2, cache_bytes=0)
    for a, b in zip(
        enc.encode(inputs, max_pixels=SMALL, decoder="dali"),
        two.encode(inputs, max_pixels=SMALL, decoder="dali"),
        strict=True,
    ):
        assert a.decoder == b.decoder
        assert_close_to_scale(np.asarray(b.features), np.asarray(a.features))


def test_a_bf16_tower_takes_dalis_values_and_host_levels_in_one_request():
    """With DALI a bf16 tower gets float32 rows from DALI (its JPEGs) and uint8 levels from the host (a PNG, a video's
    frames), each batch through its own program: every result is the PIL decoder's (all levels, one call) to bf16's
    rounding (other calls, other packings)."""
    enc = vitjax.Encoder.random(TINY["hd64"], dtype="bfloat16", cache_bytes=0)
    frames = np.random.default_rng(2).integers(0, 256, (4, 64, 96, 3), np.uint8)
    inputs = [str(PHOTOS[0]), str(PHOTOS[1]), vitjax.Video(frames)]  # a JPEG, a PNG, a video
    dali = enc.encode(inputs, max_pixels=SMALL, decoder="dali")
    assert [r.decoder for r in dali] == ["dali", "pil", "video"]
    assert {key[1].name for key in enc.parallel.engines[0]._executables} == {"float32", "uint8"}
    pil = enc.encode(inputs, max_pixels=SMALL, decoder="pil")
    for a, b in zip(dali, pil, strict=True):
        assert a.grid_thw == b.grid_thw
        assert_close_to_scale(np.asarray(a.features, np.float32), np.asarray(b.features, np.float32), 2e-2)


def test_auto_is_pil_without_a_gpu(enc):
    assert enc.resolve_decoder("auto") == "pil" and enc.resolve_decoder("dali") == "dali"
    assert enc.encode([str(PHOTOS[1])], max_pixels=SMALL)[0].decoder == "pil"
    with pytest.raises(ValueError, match="decoder must be one of auto, pil, dali"):
        enc.resolve_decoder("nvjpeg")


def test_cli_decoder_dali_writes_the_same_keys_metadata_and_features(tmp_path, capsys):
    hf_vision_model(TINY["hd64"]).save_pretrained(tmp_path / "hf")
    inputs = [str(p) for p in PHOTOS[:3]]
    written = {}
    for decoder in ("pil", "dali"):
        out = tmp_path / f"{decoder}.safetensors"
        args = ["encode", *inputs, "--model", str(tmp_path / "hf"), "--max-pixels", str(SMALL), "-o", str(out)]
        assert cli_main([*args, "--decoder", decoder]) == 0
        assert f"decoder {decoder}) to {out}" in capsys.readouterr().err
        with safe_open(out, "np") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            written[decoder] = (tensors, json.loads(f.metadata()["vitjax"]))
    (pil, meta_pil), (dali, meta_dali) = written["pil"], written["dali"]
    assert sorted(pil) == sorted(dali) and meta_pil.keys() == meta_dali.keys()
    for key in pil:  # each image's features under its own key, as close as the tower's outputs are
        x, y = pil[key].astype(np.float64).ravel(), dali[key].astype(np.float64).ravel()
        assert x.shape == y.shape and x @ y / np.linalg.norm(x) / np.linalg.norm(y) >= 0.9999, key
    assert meta_pil["decoder"] == "pil" and meta_dali["decoder"] == "dali"
    for a, b, path in zip(meta_pil["images"], meta_dali["images"], PHOTOS[:3], strict=True):
        assert a.keys() == b.keys() and a["grid_thw"] == b["grid_thw"] and a["source"] == b["source"]
        assert (a["decoder"], b["decoder"]) == ("pil", "pil" if path.suffix == ".png" else "dali")
