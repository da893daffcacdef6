"""Every setting of Encoder.encode is checked before any input is looked at, with a message naming it."""

from __future__ import annotations

import pytest
from conftest import TINY

import vitjax
from vitjax.settings import BATCH_TOKENS, EncodeSettings, SettingError

CFG = TINY["hd64"]  # patch 16, merge 2: the smallest image allowed is one 32x32 merge window


@pytest.fixture(scope="module")
def enc():
    return vitjax.Encoder.random(CFG, dtype="float32")


def untouched():
    """An input iterable that fails the test if anything reads it."""
    raise AssertionError("an input was read before the settings were checked")
    yield  # a generator: nothing runs until it is iterated


@pytest.mark.parametrize(
    ("settings", "name", "fragment"),
    [
        ({"max_pixels": 0}, "max_pixels", "must be from 1024 (one 32-pixel merge window) to pixel_limit=16777216"),
        ({"max_pixels": -5}, "max_pixels", "must be from 1024"),
        ({"max_pixels": 1000}, "max_pixels", "must be from 1024"),
        ({"max_pixels": 10**9}, "max_pixels", "raise pixel_limit deliberately"),
        ({"max_pixels": 1.5e6}, "max_pixels", "must be an integer"),
        ({"min_pixels": 0}, "min_pixels", "must be from 1 to max_pixels=16777216"),
        ({"min_pixels": 10**9}, "min_pixels", "must be from 1 to max_pixels=16777216"),
        ({"min_pixels": 70000, "max_pixels": 65536}, "min_pixels", "must be from 1 to max_pixels=65536"),
        ({"pixel_limit": 100}, "pixel_limit", "must be at least 1024"),
        ({"batch_tokens": 0}, "batch_tokens", "must be at least 1 (patches per call)"),
        ({"batch_tokens": -256}, "batch_tokens", "must be at least 1 (patches per call)"),
        ({"batch_tokens": 10**12}, "batch_tokens", "a call of 1000000000000 patches needs 2861022.9 GiB of pixel rows"),
        ({"max_pixels": 2**40, "pixel_limit": 2**40}, "max_pixels", "a call of 4294967296 patches needs 12288.0 GiB"),
        ({"batch_tokens": True}, "batch_tokens", "must be an integer"),
        (  # every frame keeps 1.05 x video_min_pixels
            {"video_min_pixels": 2**40, "video_max_pixels": 2**40, "pixel_limit": 2**40},
            "video_min_pixels",
            "a clip of 768 frames gets a budget of 1154487209164 pixels a frame: 4954521.6 GiB of pixel rows",
        ),
        ({"errors": "ignore"}, "errors", "must be one of 'raise', 'return'"),
        ({"progress": "yes"}, "progress", "must be True, False or a tqdm bar"),
        ({"decoder": "nvjpeg"}, "decoder", "must be one of 'auto', 'pil', 'dali'"),
        (
            {"image_processor_backend": "fast"},
            "image_processor_backend",
            "must be one of 'pil', 'torchvision' (HF's image processors)",
        ),
        ({"num_frames": 0}, "num_frames", "must be an integer from 2 (one temporal patch) to 768 (HF's max_frames)"),
        ({"num_frames": 1}, "num_frames", "must be an integer from 2 (one temporal patch)"),  # would fail every video
        ({"num_frames": 10**9}, "num_frames", "must be an integer from 2 (one temporal patch) to 768"),
        ({"workers": 0}, "workers", "must be an integer from 1 to 64 (threads)"),
        ({"workers": 65}, "workers", "must be an integer from 1 to 64 (threads)"),
        ({"workers": 4.0}, "workers", "must be an integer from 1 to 64 (threads)"),
        ({"workers": True}, "workers", "must be an integer from 1 to 64 (threads)"),
    ],
)
def test_bad_settings_are_refused_before_any_input_is_read(enc, settings, name, fragment):
    for errors in ("raise", "return"):  # a bad setting is never a per-input result
        with pytest.raises(SettingError) as info:
            enc.encode(untouched(), **{"errors": errors, **settings})
        error = info.value
        assert error.setting == name and error.value == settings[name]
        assert str(error).startswith(f"{name}={settings[name]!r}: ") and fragment in str(error), str(error)
        assert isinstance(error, ValueError)
    assert enc.images_encoded == 0


def test_batch_tokens_is_the_call_size_whatever_the_largest_image():
    """An image larger than batch_tokens is a call of its own: the default does not grow with max_pixels."""
    assert EncodeSettings().checked(CFG).batch_tokens == BATCH_TOKENS
    assert EncodeSettings(max_pixels=65536).checked(CFG).batch_tokens == BATCH_TOKENS
    assert EncodeSettings(batch_tokens=256).checked(CFG).batch_tokens == 256


def test_pixel_limit_is_raised_deliberately():
    with pytest.raises(SettingError, match="max_pixels=33554432: .*raise pixel_limit"):
        EncodeSettings(max_pixels=2 * 16777216).checked(CFG)
    checked = EncodeSettings(max_pixels=2 * 16777216, pixel_limit=2 * 16777216).checked(CFG)
    assert checked.max_pixels == 2 * 16777216 and checked.batch_tokens == BATCH_TOKENS
