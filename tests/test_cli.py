"""`vitjax encode` as a script sees it: checks before work, exit codes, --files-from, --summary json, atomic output."""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import MAX_PIXELS, PHOTOS, TINY
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import load_file

import vitjax
from vitjax import cli, leftovers
from vitjax.buckets import FIT_GRANULE
from vitjax.cli import main as cli_main
from vitjax.config import PRESETS


@pytest.fixture(scope="module")
def config_only(checkpoint, tmp_path_factory):
    """A model folder with a valid config.json and no weights: building a model from it fails, so a run that
    gets past its checks and fails on something else shows the check came before the model."""
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(checkpoint / "config.json", path / "config.json")
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["encode", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vitjax: error: ") and "Traceback" not in err, err
    return lines[0]


def test_version_and_help(capsys):
    for argv in (["--version"], ["encode", "--version"]):
        assert cli_main(argv) == 0 and capsys.readouterr().out == f"vitjax {vitjax.__version__}\n"
    assert cli_main(["encode", "--help"]) == 0
    text = capsys.readouterr().out
    for fragment in (
        "exit status:",
        "0  every input",
        "1  some inputs failed",
        "2  usage",
        "3  the run",
        "129, 130, 143",
        "qwen3-vl-235b-a22b",
    ):
        assert fragment in text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-pixels", "0"], "--max-pixels 0: must be from 1024 (one 32-pixel merge window)"),
        (["--max-pixels", "-5"], "--max-pixels -5: must be from 1024"),
        (
            ["--min-pixels", "70000", "--max-pixels", "65536"],
            "--min-pixels 70000: must be from 1 to --max-pixels 65536",
        ),
        (["--min-pixels", "1000000000"], "--min-pixels 1000000000: must be from 1 to --max-pixels 16777216"),
        (
            ["--max-pixels", "33554432"],
            "--max-pixels 33554432: must be from 1024 (one 32-pixel merge window) to --pixel-limit 16777216; "
            "raise --pixel-limit deliberately to allow larger images",
        ),
        (["--batch-tokens", "0"], "--batch-tokens 0: must be at least 1 (patches per call)"),
        (["--workers", "0"], "--workers 0: must be an integer from 1 to 64 (threads)"),
        (["--fps", "0"], "--fps 0.0: must be a positive number of frames per second"),
        (["--fps", "1", "--num-frames", "4"], "--num-frames 4: excludes --fps 1.0; give one of them"),
        (["--num-frames", "1"], "--num-frames 1: must be an integer from 2 (one temporal patch) to 768"),
        (["--video-max-pixels", "100"], "--video-max-pixels 100: must be from 1024 to --pixel-limit 16777216"),
        (["--sequence-parallel", "3"], "--devices 1 --sequence-parallel 3: sequence_parallel=3 does not divide"),
        (
            ["--devices", "4", "--sequence-parallel", "4"],
            "--devices 4 --sequence-parallel 4: sequence_parallel=4 does not divide the tower's 2 heads",
        ),
        (["--fit-granule", "6"], "--fit-granule 6: must be 0 (off) or a multiple of 4"),
        (["--fit-granule", "-4"], "--fit-granule -4: must be 0 (off) or a multiple of 4"),
        (
            ["--devices", "2", "--sequence-parallel", "2", "--fit-granule", "12"],
            "--fit-granule 12 --sequence-parallel 2: bucket tokens (512, ",
        ),
        (["--batch-tokens", str(10**12)], f"--batch-tokens {10**12}: a call of {10**12} patches needs 2861022.9 GiB"),
        (  # one image as large as these allow sets the call's size
            ["--pixel-limit", str(2**40), "--max-pixels", str(2**40)],
            f"--max-pixels {2**40}: a call of {2**32} patches needs 12288.0 GiB of pixel rows, more than this machine",
        ),
    ],
)
def test_bad_settings_are_one_line_before_the_model(config_only, tmp_path, capsys, options, message):
    out = tmp_path / "out.safetensors"
    code, stdout, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", str(out), *options)
    assert code == 2 and message in one_error_line(err) and not stdout
    assert list(tmp_path.iterdir()) == []


def test_unknown_preset_and_model_paths_are_one_line(config_only, tmp_path, capsys):
    out = str(tmp_path / "out.safetensors")
    code, _, err = run(capsys, str(PHOTOS[0]), "--random-init", "qwen3-vl-9b", "-o", out)
    assert code == 2 and "--random-init qwen3-vl-9b: unknown preset 'qwen3-vl-9b'; choose one of" in one_error_line(err)
    code, _, err = run(capsys, str(PHOTOS[0]), "--random-init", "", "-o", out)  # named, if empty: no --model then
    assert code == 2 and "--random-init : unknown preset ''; choose one of" in one_error_line(err)
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(tmp_path / "nowhere"), "-o", out)
    assert code == 2 and f"--model {tmp_path / 'nowhere'}: no such directory" in one_error_line(err)
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(PHOTOS[0]), "-o", out)  # a file, not a checkpoint
    assert code == 2 and f"--model {PHOTOS[0]}: not a directory" in one_error_line(err)
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(tmp_path), "-o", out)
    assert code == 2 and f"no config.json at {tmp_path / 'config.json'}" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []
    damaged = tmp_path / "damaged"
    shutil.copytree(config_only, damaged)
    (damaged / "model.safetensors").write_bytes(b"\x10" * 100)
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(damaged), "-o", out)
    assert code == 2 and f"{damaged / 'model.safetensors'}: not a readable safetensors file" in one_error_line(err)
    assert not (tmp_path / "out.safetensors").exists()


def test_output_is_checked_before_encoding(config_only, tmp_path, capsys):
    missing = tmp_path / "no" / "out.safetensors"
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", str(missing))
    assert code == 2 and f"-o {missing}: folder {missing.parent} does not exist" in one_error_line(err)
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", str(tmp_path))
    assert code == 2 and f"-o {tmp_path}: is a directory" in one_error_line(err)
    code, _, err = run(capsys, "--model", str(config_only), "-o", str(tmp_path / "out.safetensors"))
    assert code == 2 and "no inputs" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_output_that_is_an_input_is_refused(config_only, tmp_path, capsys):
    """-o naming one of the inputs, given alone or found in a folder: refused before anything is read or written."""
    folder = tmp_path / "photos"
    folder.mkdir()
    photo = folder / "a.jpg"
    shutil.copy(PHOTOS[0], photo)
    for inputs in ([str(folder)], [str(PHOTOS[1]), str(photo)]):
        code, stdout, err = run(capsys, *inputs, "--model", str(config_only), "-o", str(photo))
        assert code == 2 and not stdout
        assert one_error_line(err) == f"vitjax: error: -o {photo}: is the input {photo}; write the output elsewhere"
    assert photo.read_bytes() == PHOTOS[0].read_bytes() and [p.name for p in tmp_path.iterdir()] == ["photos"]


def test_output_that_is_the_files_list_or_a_model_file_is_refused(config_only, tmp_path, capsys, monkeypatch):
    """The weights are in memory by the time the output is renamed into place: it must not replace one of their
    files, nor the --files-from list."""
    model = tmp_path / "model"
    shutil.copytree(config_only, model)
    listed = tmp_path / "list.txt"
    listed.write_text(f"{PHOTOS[0]}\n")
    for output, what in ((model / "config.json", f"a file of --model {model}"), (listed, f"--files-from {listed}")):
        code, stdout, err = run(capsys, "--files-from", str(listed), "--model", str(model), "-o", str(output))
        assert code == 2 and not stdout
        assert one_error_line(err) == f"vitjax: error: -o {output}: is {what}; write the output elsewhere"
    # `--files-from - < list.txt -o list.txt`: standard input is that file
    kept = os.dup(0)
    with open(listed, "rb") as stdin, monkeypatch.context() as m:
        os.dup2(stdin.fileno(), 0)
        m.setattr(sys, "stdin", io.TextIOWrapper(stdin))
        try:
            code, stdout, err = run(capsys, "--files-from", "-", "--model", str(model), "-o", str(listed))
        finally:
            os.dup2(kept, 0)
            os.close(kept)
    assert code == 2 and not stdout
    assert one_error_line(err) == f"vitjax: error: -o {listed}: is --files-from -; write the output elsewhere"
    assert (
        listed.read_text() == f"{PHOTOS[0]}\n"
        and (model / "config.json").read_bytes() == (config_only / "config.json").read_bytes()
    )


def test_videos_without_pyav_are_refused_before_the_model(config_only, tmp_path, capsys, monkeypatch):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not decoded: the check comes first")
    monkeypatch.setitem(sys.modules, "av", None)  # what an install without the [video] extra looks like to Python
    out = tmp_path / "out.safetensors"
    code, stdout, err = run(capsys, str(PHOTOS[0]), str(clip), "--model", str(config_only), "-o", str(out))
    assert code == 2 and not stdout
    assert one_error_line(err) == "vitjax: error: video inputs need PyAV to decode them: pip install 'vitjax[video]'"
    assert not out.exists()


def test_output_naming_a_folder_or_a_special_file_is_refused(config_only, tmp_path, capsys):
    """A name ending in a separator is a folder, even one not there (not a file named like it); a FIFO or a device
    is not replaced by a regular file."""
    for output in (f"{tmp_path}/new/", f"{tmp_path}/new/."):
        code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", output)
        assert code == 2 and one_error_line(err) == f"vitjax: error: -o {output}: names a folder; give a file name"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for output in (str(fifo), os.devnull):
        code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", output)
        assert code == 2 and one_error_line(err) == f"vitjax: error: -o {output}: exists and is not a regular file"
    assert stat.S_ISFIFO(fifo.stat().st_mode) and stat.S_ISCHR(os.stat(os.devnull).st_mode)
    output = str(tmp_path / ("e" * 300 + ".safetensors"))  # past the 255-byte limit on a file name
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", output)
    assert code == 2 and one_error_line(err) == f"vitjax: error: -o {output}: File name too long"
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_temporary_files_of_killed_runs_are_removed(config_only, tmp_path, capsys):
    """SIGKILL or the OOM killer skips every cleanup: a later run into the folder removes the temporary files such
    runs left (an hour old), not one a live run may be writing, nor other files."""
    names = [f"{cli.TEMP_PREFIX}{'0' * 32}.tmp", f"{cli.TEMP_PREFIX}abcd1234.probe", f"{cli.TEMP_PREFIX}{'a' * 32}.tmp"]
    *killed, live = (tmp_path / name for name in names)
    other = tmp_path / "old.safetensors"
    for path in (*killed, live, other):
        path.write_bytes(b"x")
        if path is not live:
            hour_ago = time.time() - leftovers.STALE_SECONDS - 1
            os.utime(path, (hour_ago, hour_ago))
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(config_only), "-o", str(other), "--fit-granule", "3")
    assert code == 2 and "--fit-granule 3" in one_error_line(err)  # refused after the output's check
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_long_output_name_is_written(checkpoint, tmp_path, capsys):
    """A file name of 248 characters (the limit is 255): the probe and temporary names must not be longer."""
    out = tmp_path / ("e" * 236 + ".safetensors")
    code, _, err = run(
        capsys, str(PHOTOS[0]), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out)
    )
    assert code == 0 and "wrote 1 of 1 images" in err
    assert set(load_file(out)) == {"0.embeds", "0.deepstack"} and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_workers_are_the_runs_preprocessing_threads(checkpoint, tmp_path, capsys, monkeypatch):
    pools = []

    class Recorded(vitjax.encoder.Pipeline):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self._pool._max_workers)

    monkeypatch.setattr(vitjax.encoder, "Pipeline", Recorded)
    out = tmp_path / "e.safetensors"
    args = [str(p) for p in PHOTOS] + ["--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out)]
    code, _, err = run(capsys, *args, "--workers", "3")
    assert code == 0 and f"wrote {len(PHOTOS)} of {len(PHOTOS)} images" in err and pools and set(pools) == {3}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"depth": 3,', "not a JSON config (Expecting property name enclosed in double quotes"),
        ('{"depth": "\xff"}', "not a JSON config ('utf-8' codec can't decode byte 0xff"),  # written as Latin-1
        ('{"vision_config": 5}', "vision_config must be a JSON object, got int"),
        ({"depth": "3"}, "depth must be a positive integer, got '3'"),
        ({"num_heads": 0}, "num_heads must be a positive integer, got 0"),
        ({"patch_size": None}, "patch_size must be a positive integer, got None"),
        ({"deepstack_visual_indexes": 5}, "deepstack_visual_indexes must be a list of block numbers, got 5"),
        ({"rope_parameters": "x"}, "rope_parameters must be a JSON object, got 'x'"),
    ],
)
def test_malformed_config_is_one_line(checkpoint, tmp_path, capsys, text, message):
    """A config.json that cannot describe a tower: one line naming the file, exit 2, for encode and convert alike."""
    model = tmp_path / "model"
    model.mkdir()
    if isinstance(text, dict):
        text = json.dumps({**json.loads((checkpoint / "config.json").read_text()), **text})
    (model / "config.json").write_bytes(text.encode("latin-1"))
    code, _, err = run(capsys, str(PHOTOS[0]), "--model", str(model), "-o", str(tmp_path / "out.safetensors"))
    assert code == 2 and f"vitjax: error: --model {model}: {model / 'config.json'}: {message}" in one_error_line(err)
    assert cli_main(["convert", str(model), str(tmp_path / "converted"), "-q"]) == 2
    prefix = f"vitjax: error: convert {model} {tmp_path / 'converted'}: {model / 'config.json'}: {message}"
    assert prefix in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_inputs_certain_to_fail_are_found_before_the_model(config_only, tmp_path, capsys):
    """An empty folder, a folder without images or videos and a URL (the CLI reads files only) fail as a missing
    file does: named, exit 1, without building the model (which would fail: no weights)."""
    empty, notes = tmp_path / "empty", tmp_path / "notes"
    empty.mkdir()
    notes.mkdir()
    (notes / "readme.txt").write_text("no pictures")
    url = "https://example.com/a.jpg"
    out = tmp_path / "out.safetensors"
    code, stdout, err = run(capsys, str(empty), str(notes), url, "--model", str(config_only), "-o", str(out), "-q")
    none = "directory contains no image or video files (3gp, avi, avif, bmp,"
    lines = err.splitlines()
    assert code == 1 and not out.exists() and not stdout and len(lines) == 3, err
    assert lines[0].startswith(f"vitjax: error: {empty}: {none}") and lines[1].startswith(
        f"vitjax: error: {notes}: {none}"
    )
    assert lines[2] == f"vitjax: error: {url}: URLs are not fetched; download the image and pass its bytes or path"


def test_missing_inputs_are_found_before_the_model(config_only, tmp_path, capsys):
    """Nothing to encode: exit 1 without building the model (which would fail: no weights) and without a file."""
    gone = [str(tmp_path / "a.jpg"), str(tmp_path / "b.png")]
    out = tmp_path / "out.safetensors"
    code, stdout, err = run(capsys, *gone, "--model", str(config_only), "-o", str(out), "--summary", "json")
    assert code == 1 and not out.exists()
    assert [line for line in err.splitlines() if "error" in line] == [f"vitjax: error: {g}: no such file" for g in gone]
    summary = json.loads(stdout)
    assert summary["written"] == 0 and summary["output"] is None and summary["tokens"] == 0
    assert summary["failed"] == [{"index": i, "source": g, "error": "no such file"} for i, g in enumerate(gone)]
    out.write_bytes(b"an earlier run's output")  # stays as it was: nothing replaces it
    code, _, _ = run(capsys, *gone, "--model", str(config_only), "-o", str(out))
    assert code == 1 and out.read_bytes() == b"an earlier run's output"


def test_files_from_stdin_summary_json_and_quiet(checkpoint, tmp_path, capsys, monkeypatch):
    listing = tmp_path / "inputs.txt"
    missing = str(tmp_path / "missing.jpg")
    listing.write_text(f"{PHOTOS[1]}\n\n{missing}\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PHOTOS[2]}\n"))  # text only, as an embedding caller's
    out = tmp_path / "out.safetensors"
    common = ["--model", str(checkpoint), "--dtype", "float32", "--max-pixels", str(MAX_PIXELS), "-o", str(out)]
    code, stdout, err = run(
        capsys, str(PHOTOS[0]), "--files-from", str(listing), *common, "--summary", "json", "--quiet"
    )
    assert code == 1 and err == f"vitjax: error: {missing}: no such file\n"  # quiet: no bar, no notes
    assert len(stdout.splitlines()) == 1
    summary = json.loads(stdout)
    tensors = load_file(out)
    assert summary["written"] == 2 and summary["output"] == str(out) and summary["seconds"] > 0
    assert summary["decoder"] == "pil"  # no DALI, no GPU: what made the pixels, also with --quiet
    assert summary["failed"] == [{"index": 2, "source": missing, "error": "no such file"}]
    assert summary["tokens"] == len(tensors["0.embeds"]) + len(tensors["1.embeds"]) and "2.embeds" not in tensors
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    for i, photo in enumerate(PHOTOS[:2]):  # each equals encoding it alone
        (alone,) = enc.encode([photo], max_pixels=MAX_PIXELS)
        np.testing.assert_allclose(tensors[f"{i}.embeds"], np.asarray(alone.embeds), rtol=1e-5, atol=1e-5)
    code, stdout, err = run(capsys, "--files-from", "-", *common)
    assert code == 0 and not stdout and "encoding" in err and "wrote 1 of 1 images" in err
    assert load_file(out)["0.embeds"].shape[1] == enc.cfg.out_hidden_size


def test_inputs_go_in_chunks_and_come_back_in_their_slots(checkpoint, tmp_path, capsys, monkeypatch):
    """The encoder gets the inputs a chunk at a time, as many as fit CHUNK_BYTES at the largest embedding the settings
    allow (each chunk's go to the host once the next is dispatched, so the device holds two chunks' at most); each
    input lands in its own slot."""
    cfg = TINY["hd64"]  # the checkpoint's tower; the largest embedding MAX_PIXELS allows, in float32:
    one = MAX_PIXELS // cfg.patch_size**2 // cfg.merge_unit * cfg.output_width * 4
    monkeypatch.setattr(cli, "CHUNK_BYTES", 2 * one + 1)
    chunks, encode = [], vitjax.Encoder.encode
    monkeypatch.setattr(
        vitjax.Encoder, "encode", lambda self, images, **kw: chunks.append(len(images)) or encode(self, images, **kw)
    )
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"\xff\xd8 not a JPEG")
    inputs = [*map(str, PHOTOS[:2]), str(corrupt), *map(str, PHOTOS[2:4])]
    out = tmp_path / "out.safetensors"
    common = ["--model", str(checkpoint), "--dtype", "float32", "--max-pixels", str(MAX_PIXELS), "-o", str(out)]
    code, _, err = run(capsys, *inputs, *common)
    assert code == 1 and f"vitjax: error: {corrupt}: " in err and "wrote 4 of 5 images" in err
    assert chunks == [2, 2, 1]
    tensors = load_file(out)
    assert sorted(tensors) == [f"{i}.{k}" for i in (0, 1, 3, 4) for k in ("deepstack", "embeds")]
    enc = vitjax.Encoder.from_pretrained(checkpoint, dtype="float32")
    for i, photo in zip((0, 1, 3, 4), PHOTOS[:4], strict=True):
        (alone,) = enc.encode([photo], max_pixels=MAX_PIXELS)
        np.testing.assert_allclose(tensors[f"{i}.embeds"], np.asarray(alone.embeds), rtol=1e-5, atol=1e-5)


def test_files_from_takes_any_file_name_one_per_line(checkpoint, tmp_path, capsys, monkeypatch):
    """Names with line-separator characters other than a newline, bytes that are not UTF-8, and a name that starts
    with "data:" (a file here, not a data URI), from a file and from standard input."""
    monkeypatch.chdir(tmp_path)  # names relative to it: "data:camera.png" starts with "data:"
    odd = [
        Path("next\x85line.png"),
        Path("para\u2028graph.png"),
        Path(os.fsdecode(b"latin\xe9.png")),
        Path("data:camera.png"),
    ]
    for path in odd:
        shutil.copy(PHOTOS[0], path)
    listing = b"".join(os.fsencode(p) + b"\r\n" for p in odd)
    (tmp_path / "list.txt").write_bytes(listing)
    out = tmp_path / "out.safetensors"
    common = ["--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out), "--summary", "json", "-q"]
    for source in (str(tmp_path / "list.txt"), "-"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(listing)))
        code, stdout, err = run(capsys, "--files-from", source, *common)
        assert code == 0 and json.loads(stdout)["written"] == len(odd), err
        assert len(load_file(out)) == 2 * len(odd)
    code, stdout, err = run(capsys, str(odd[3]), *common)  # as an argument too
    assert code == 0 and json.loads(stdout)["written"] == 1, err


def test_seed_out_of_range_is_a_usage_error(tmp_path, capsys):
    for seed in (str(2**64), "²"):
        code, _, err = run(capsys, str(PHOTOS[0]), "--random-init", "qwen3-vl-2b", "--seed", seed, "-o", "x")
        assert code == 2 and f"--seed: expected a whole number from -2**63 to 2**63 - 1, got '{seed}'" in err


def test_random_weights_are_recorded_under_the_presets_own_name(tmp_path, capsys, monkeypatch):
    """`--random-init 2b` and `Qwen/Qwen3-VL-2B` are one preset (a tiny tower stands in for it here): the same
    weights, and the output's metadata names them one way."""
    monkeypatch.setitem(PRESETS, "qwen3-vl-2b", TINY["hd64"])
    embeds = []
    for i, name in enumerate(("2b", "Qwen/Qwen3-VL-2B")):
        out = tmp_path / f"{i}.safetensors"
        options = ["--random-init", name, "--seed", "3", "--dtype", "float32", "--max-pixels", str(MAX_PIXELS), "-q"]
        assert run(capsys, str(PHOTOS[0]), *options, "-o", str(out))[0] == 0
        with safe_open(out, "np") as f:
            assert json.loads(f.metadata()["vitjax"])["model"] == "random-init:qwen3-vl-2b:seed=3"
        embeds.append(load_file(out)["0.embeds"])
    assert embeds[0].shape[1] == TINY["hd64"].out_hidden_size
    np.testing.assert_array_equal(*embeds)


def test_an_attention_path_the_dtype_rules_out_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """$VITJAX_ATTENTION names a flash path, which takes 16-bit towers only: --dtype float32 is refused before the
    model is built (it used to fail in the first compile on a GPU, after the checkpoint was read)."""
    monkeypatch.setenv("VITJAX_ATTENTION", "cudnn_padded")
    built = []
    monkeypatch.setattr(vitjax.Encoder, "random", lambda *a, **kw: built.append(a))
    out = tmp_path / "e.safetensors"
    code, _, err = run(capsys, str(PHOTOS[0]), "--random-init", "qwen3-vl-2b", "--dtype", "float32", "-o", str(out))
    assert code == 2 and built == [] and not out.exists()
    assert "--dtype float32: $VITJAX_ATTENTION 'cudnn_padded' takes bfloat16 or float16 towers, not float32" in err


@pytest.mark.parametrize(
    "value, message",
    [
        ("flash", "$VITJAX_ATTENTION: unknown attention implementation 'flash'; choose one of"),
        ("cudnn_padded", "$VITJAX_ATTENTION 'cudnn_padded' runs on CUDA GPUs only, not on cpu devices"),
    ],
)
def test_an_attention_path_that_cannot_run_here_names_the_variable(tmp_path, capsys, monkeypatch, value, message):
    """Not blamed on --dtype (which was not given), and not found after the model is built (exit 3)."""
    monkeypatch.setenv("VITJAX_ATTENTION", value)
    built = []
    monkeypatch.setattr(vitjax.Encoder, "random", lambda *a, **kw: built.append(a))
    out = tmp_path / "e.safetensors"
    code, _, err = run(capsys, str(PHOTOS[0]), "--random-init", "qwen3-vl-2b", "-o", str(out))
    assert code == 2 and built == [] and not out.exists() and message in one_error_line(err)


def test_fit_granule_reaches_the_encoder(checkpoint, tmp_path, capsys, monkeypatch):
    """The encoder is built with the bucket policy --fit-granule asks for (vitjax's default without it)."""
    built = []
    load = vitjax.Encoder.from_pretrained

    def recording(path, **kw):
        built.append(kw["buckets"].fit_granule)
        return load(path, **kw)

    monkeypatch.setattr(vitjax.Encoder, "from_pretrained", recording)
    common = [str(PHOTOS[0]), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-q"]
    assert run(capsys, *common, "-o", str(tmp_path / "a.safetensors"), "--fit-granule", "0")[0] == 0
    assert run(capsys, *common, "-o", str(tmp_path / "b.safetensors"))[0] == 0
    assert built == [0, FIT_GRANULE]
    np.testing.assert_array_equal(
        load_file(tmp_path / "a.safetensors")["0.embeds"], load_file(tmp_path / "b.safetensors")["0.embeds"]
    )


def test_broken_link_in_a_folder_is_named_and_the_rest_written(checkpoint, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.jpg").symlink_to(PHOTOS[0])
    (folder / "b.jpg").symlink_to(folder / "deleted.jpg")
    out = tmp_path / "out.safetensors"
    code, _, err = run(capsys, str(folder), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out))
    assert code == 1 and f"{folder / 'b.jpg'}: broken symbolic link (to {folder / 'deleted.jpg'})" in err
    assert "wrote 1 of 2 images" in err and set(load_file(out)) == {"0.embeds", "0.deepstack"}


def test_unreadable_folder_is_named_and_the_rest_written(checkpoint, tmp_path):
    """A folder that cannot be listed is one error naming it, and the other inputs are written. The script runs in a
    process that meets file permissions: as root (CI), with root's bypass dropped by util-linux's setpriv."""
    inputs = tmp_path / "in"
    (inputs / "locked").mkdir(parents=True)
    Image.new("RGB", (64, 64)).save(inputs / "locked" / "x.png")
    shutil.copy(PHOTOS[0], inputs / PHOTOS[0].name)
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    if prefix and (shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0):
        pytest.skip("root reads every folder, and setpriv cannot drop that here")
    out = tmp_path / "out.safetensors"
    (inputs / "locked").chmod(0)
    try:
        argv = [str(inputs), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out)]
        proc = subprocess.run([*prefix, sys.executable, "-m", "vitjax.cli", "encode", *argv], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    finally:
        (inputs / "locked").chmod(0o755)
    assert proc.returncode == 1, proc.stderr
    assert f"{inputs / 'locked'}: cannot list directory (Permission denied" in proc.stderr
    assert "wrote 1 of 2" in proc.stderr and set(load_file(out)) == {"0.embeds", "0.deepstack"}


def test_output_has_the_umask_permissions(checkpoint, tmp_path, capsys):
    out = tmp_path / "out.safetensors"
    old = os.umask(0o027)
    try:
        code, _, _ = run(
            capsys,
            str(PHOTOS[0]),
            "--model",
            str(checkpoint),
            "--min-pixels",
            "4096",
            "--max-pixels",
            "4096",
            "-o",
            str(out),
        )
    finally:
        os.umask(old)
    assert code == 0 and out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]  # no probe or temporary file left


def test_an_output_link_keeps_pointing_at_the_new_file(checkpoint, tmp_path, capsys):
    """`-o latest.safetensors` that links to a run's file: the file is replaced and the link stays (it was replaced
    by a regular file, leaving its target stale)."""
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "a.safetensors"
    target.write_bytes(b"an earlier run")
    link = tmp_path / "latest.safetensors"
    link.symlink_to(target)
    options = ["--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-q", "-o", str(link)]
    assert run(capsys, str(PHOTOS[0]), *options)[0] == 0
    assert link.is_symlink() and link.resolve() == target
    assert set(load_file(target)) == {"0.embeds", "0.deepstack"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.safetensors", "runs"]
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    code, _, err = run(capsys, str(PHOTOS[0]), *options[:-1], str(loop))
    assert code == 2 and one_error_line(err).startswith(f"vitjax: error: -o {loop}: ")


def test_failed_write_leaves_the_old_file_and_no_partial_one(checkpoint, tmp_path, capsys):
    """A real write failure (the file size limit, as a full disk would) after encoding: a clear message, exit 1,
    the previous file under the final name untouched, no temporary file left."""
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous run")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG, not kill the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        code, stdout, err = run(
            capsys, str(PHOTOS[0]), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out),
            "--summary", "json",
        )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert code == 1 and f"vitjax: error: cannot write {out}: " in err and "nothing was written" in err
    assert "Traceback" not in err and "wrote" not in err
    assert out.read_bytes() == b"previous run" and [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    summary = json.loads(stdout)
    assert summary["written"] == 0 and summary["error"].startswith(f"cannot write {out}")


def test_an_interrupt_is_one_line(monkeypatch, capsys):
    """Ctrl-C: one line and the shell's status for SIGINT, no traceback (outputs are written whole or not at all)."""

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_encode", interrupted)
    assert cli_main(["encode", "x.jpg", "--random-init", "qwen3-vl-2b", "-o", "out.safetensors"]) == 130
    assert capsys.readouterr().err == "vitjax: interrupted\n"


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGHUP as a command started from a terminal gets them (a test run started in the background or
    under `nohup` passes them on ignored, and a run keeps what it was started ignoring); put back after."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, signal.SIG_DFL if handler is None else handler)


def test_a_hang_up_stops_a_run_as_sigterm_does_unless_it_was_ignored(monkeypatch, capsys, terminal_signals):
    """SIGHUP (the terminal or ssh session closed) is cleaned up and reported as SIGTERM is; under `nohup`, which
    starts the process ignoring it, the run goes on. The handlers that were there are put back."""

    def hung_up(args):
        os.kill(os.getpid(), signal.SIGHUP)
        return 0

    monkeypatch.setattr(cli, "_encode", hung_up)
    argv = ["encode", "x.jpg", "--random-init", "qwen3-vl-2b", "-o", "out.safetensors"]
    before = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGINT)
    assert cli_main(argv) == 128 + signal.SIGHUP and capsys.readouterr().err == "vitjax: hung up\n"
    assert (signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGINT)) == before
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    assert cli_main(argv) == 0 and capsys.readouterr().err == ""
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_whose_exception_python_drops_still_stops_the_run(
    checkpoint, tmp_path, capsys, monkeypatch, signum, terminal_signals
):
    """A signal that comes while a `__del__` runs (tqdm's bar, JAX's arrays) raises there, and Python drops that
    exception: the run still stops before it writes, with the signal's status (it used to write and exit 0)."""
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)

    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signum)

    encode = cli._run_encoder

    def encode_then_collect(*args, **kwargs):
        result = encode(*args, **kwargs)
        Collected()  # collected at once
        return result

    monkeypatch.setattr(cli, "_run_encoder", encode_then_collect)
    out = tmp_path / "out.safetensors"
    code, _, err = run(
        capsys, str(PHOTOS[0]), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out)
    )
    stopped = KeyboardInterrupt if signum == signal.SIGINT else cli.Terminated
    assert [type(d.exc_value) for d in dropped] == [stopped]
    assert code == 128 + signum and err.endswith("interrupted\n" if signum == signal.SIGINT else "terminated\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stdout", ["pipe without a reader", "closed", "/dev/full"])
def test_a_closed_standard_output_costs_only_the_summary(checkpoint, tmp_path, stdout):
    """`--summary json` into a pipe whose reader has left, with stdout closed, or into a full device: the output is
    written all the same, and the status (1) and one line say what was lost (it was status 3 and "nothing was
    written" after a traceback for the pipe and the full device; status 0, the line lost silently, when closed)."""
    if stdout == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    out = tmp_path / "out.safetensors"
    argv = [str(PHOTOS[0]), "--model", str(checkpoint), "--max-pixels", str(MAX_PIXELS), "-o", str(out), "--summary",
            "json", "-q"]  # fmt: skip
    command = [sys.executable, "-m", "vitjax.cli", "encode", *argv]
    read, write = os.pipe()
    os.close(read)
    full = open("/dev/full", "w") if stdout == "/dev/full" else None  # noqa: SIM115
    try:
        given = {"pipe without a reader": write, "closed": None, "/dev/full": full}[stdout]
        if stdout == "closed":  # Python starts without a stdout (a shell's `>&-`)
            command = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
        proc = subprocess.run(command, stdout=given, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
        if full is not None:
            full.close()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "nothing was written" not in proc.stderr
    lost = "standard output: No space left on device" if stdout == "/dev/full" else "standard output is closed"
    assert proc.stderr.endswith(f"vitjax: error: the summary was not printed: {lost}\n")
    assert set(load_file(out)) == {"0.embeds", "0.deepstack"}


def test_a_failure_of_the_run_itself_is_status_3_with_its_traceback(monkeypatch, capsys):
    """Out of memory (or a defect) is not an input's fault: not status 1, which names failed inputs."""

    def out_of_memory(args):
        raise MemoryError("Unable to allocate 114. GiB")

    monkeypatch.setattr(cli, "_encode", out_of_memory)
    assert cli_main(["encode", "x.jpg", "--random-init", "qwen3-vl-2b", "-o", "out.safetensors"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "MemoryError: Unable to allocate 114. GiB" in err
    assert err.endswith("vitjax: error: the run failed (above); nothing was written\n")
