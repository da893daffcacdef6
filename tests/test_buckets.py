"""The bucket policy: which shapes exist, which bucket a call gets, and how a request is cut into calls."""

from __future__ import annotations

import pytest

from vitjax.buckets import Bucket, BucketPolicy
from vitjax.video import MAX_FRAMES

POLICY = BucketPolicy(tokens=(64, 128, 256), segments=(1, 8), granule=64)


def test_policy_fit_and_plan():
    assert POLICY.fit(64, 1) == Bucket(64, 1)
    assert POLICY.fit(65, 3) == Bucket(128, 8)
    assert POLICY.fit(300, 1) == Bucket(320, 1)  # past the ladder: dedicated, rounded to the granule
    assert POLICY.fit(100, 9) == Bucket(128, 9)
    grids = [(1, 8, 8), (1, 8, 12), (1, 4, 4), (1, 16, 18), (1, 2, 2)]  # 64, 96, 16, 288, 4 tokens
    plan = POLICY.plan(grids)
    assert [images for _, images in plan] == [[0, 1, 2], [3], [4]]
    assert [b for b, _ in plan] == [Bucket(256, 8), Bucket(320, 1), Bucket(64, 1)]
    assert [images for _, images in POLICY.plan([(1, 2, 2)] * 10)] == [list(range(8)), [8, 9]]
    assert POLICY.buckets() == [Bucket(64, 1), Bucket(128, 1), Bucket(256, 1)]  # frames of >= 256 patches
    assert len(BucketPolicy().buckets()) == 100


@pytest.mark.parametrize("frame", [256, 300, 1024, 3520, 4800])
def test_the_warm_up_set_holds_every_call_of_frames_of_the_minimum_size_or_more(frame):
    """After `warmup()` no call compiles: every call of n frames of at least `MIN_FRAME_TOKENS` patches whose bucket is
    on the ladders is in the default set (2 x 256 patches: 512 tokens, 4 slots)."""
    policy = BucketPolicy()
    warm = set(policy.buckets())
    for n in range(1, policy.segments[-1] + 1):
        if n * frame <= policy.tokens[-1]:
            assert policy.fit(n * frame, n) in warm, (n, frame)


def test_policy_refuses_bad_sizes():
    with pytest.raises(ValueError, match="multiples of 4"):
        BucketPolicy(tokens=(6,))
    for granule in (0, -1024):  # else a call past the ladder would divide by zero, or get a 0-token bucket
        with pytest.raises(ValueError, match=f"bucket granule must be a positive multiple of 4, got {granule}"):
            BucketPolicy(granule=granule)


def test_padded_plans_cut_a_long_frame_away_from_many_short_ones():
    """cuDNN's padded batch gives every slot the longest frame's length: a 16.7 MP photo among 19 small ones would be
    64 slots x 65,536 rows (9 GiB for each of q, k, v at the 8B tower); the padded plan keeps it with 3 of them."""
    policy = BucketPolicy()
    grids = [(1, 256, 256)] + [(1, 40, 38)] * 19
    assert [(b, len(c)) for b, c in policy.plan(grids)] == [(Bucket(98304, 64), 20)]
    padded = policy.plan(grids, padded=True)
    assert [(b, c) for b, c in padded] == [(Bucket(81920, 4), [0, 1, 2, 3]), (Bucket(24576, 16), list(range(4, 20)))]
    rows = [policy.padded_rows(b, max(grids[i][1] * grids[i][2] for i in c)) for b, c in padded]
    assert rows == [4 * 65536, 16 * 1536]


def test_padded_plans_of_equal_frames_are_the_packed_ones():
    """Calls of equal frames (images, or one video's slices) are never cut for the padded batch's sake, at any frame
    size and count the default ladders hold (a plan of the most that fit in one call checks every shorter one too)."""
    policy = BucketPolicy()
    for frame in range(4, policy.tokens[-1] + 1, 4):
        grids = [(1, 2, frame // 2)] * min(policy.segments[-1], policy.tokens[-1] // frame)
        assert policy.plan(grids, padded=True) == policy.plan(grids), frame


def test_policy_fitted_buckets():
    """A call's fitted bucket: its tokens rounded up to the fit granule, its slots; none where that saves nothing."""
    fit = BucketPolicy(tokens=(64, 128, 256), segments=(1, 8), granule=64, fit_granule=32)
    assert fit.fitted(Bucket(256, 8), 200) == Bucket(224, 8)
    assert fit.fitted(Bucket(256, 8), 225) is None  # rounds to 256: the ladder's own bucket
    assert fit.fitted(Bucket(64, 1), 33) is None
    assert POLICY.fitted(Bucket(256, 8), 200) is None  # the default granule (2048) is larger than this ladder
    twenty_photos = BucketPolicy().plan([(1, 80, 60)] * 20)[0][0]
    assert BucketPolicy().fitted(twenty_photos, 96000) == Bucket(96256, 64)
    assert BucketPolicy(fit_granule=0).fitted(twenty_photos, 96000) is None
    assert BucketPolicy().fitted(Bucket(65536, 16), 65280) is None  # 8 x 1080p: 65,536 either way
    with pytest.raises(ValueError, match="fit_granule"):
        BucketPolicy(fit_granule=6)


def test_default_sampled_videos_fit_the_segment_ladder():
    """Every clip HF's sampling can give (up to MAX_FRAMES frames, two per slice) lands on a rung of the default
    ladder, so no video length compiles an executable of its own; the images' buckets are as before."""
    policy = BucketPolicy()
    assert policy.segments[-1] == MAX_FRAMES // 2
    fits = {t: policy.plan([(t, 16, 30)]) for t in (60, 65, 129, 257, MAX_FRAMES // 2)}
    assert {t: [b for b, _ in plan] for t, plan in fits.items()} == {
        60: [Bucket(32768, 64)],
        65: [Bucket(32768, 128)],
        129: [Bucket(65536, 256)],
        257: [Bucket(131072, 384)],
        384: [Bucket(184320, 384)],  # past the token ladder: dedicated tokens, a rung's slots
    }
    assert [b for b, _ in policy.plan([(1, 80, 60)] * 20)] == [Bucket(98304, 64)]
    assert all(b in policy.buckets() for t in (65, 129, 257) for b, _ in fits[t])
