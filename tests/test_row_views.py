"""Row views of device arrays: shared memory where aligned, a copy elsewhere, through JAX's private entry points."""

from __future__ import annotations

import gc
import logging
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from vitjax import row_views
from vitjax.notices import notice_once
from vitjax.row_views import row_view


def test_row_views_share_memory_and_outlive_their_parent():
    x = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16)  # 64-byte rows
    expected = np.asarray(x)
    aligned = row_view(x, 8, 20)  # starts 512 bytes in: a view of x's memory
    assert aligned.unsafe_buffer_pointer() - x.unsafe_buffer_pointer() == 8 * 64
    assert row_view(x, 0, 64) is x
    y = jnp.arange(64 * 30, dtype=jnp.float32).reshape(64, 30)  # 120-byte rows
    odd = row_view(y, 1, 5)  # starts off every alignment a runtime takes: a copy
    start, end = y.unsafe_buffer_pointer(), y.unsafe_buffer_pointer() + y.nbytes
    assert not start <= odd.unsafe_buffer_pointer() < end
    odd_expected = np.asarray(y)[1:6]
    del x, y
    gc.collect()
    np.testing.assert_array_equal(aligned, expected[8:28])
    np.testing.assert_array_equal(odd, odd_expected)


def test_row_views_through_jax_private_dlpack_entry_points():
    """The installed JAX still has the private DLPack entry points `row_view` takes (else every view pays the public
    path's ~94 µs), and their view is the rows, on the parent's device and memory."""
    x = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16)
    view = row_views._import_rows(x, 8, 20)
    assert view is not None
    assert view.devices() == x.devices()
    assert view.unsafe_buffer_pointer() - x.unsafe_buffer_pointer() == 8 * 64
    np.testing.assert_array_equal(view, np.asarray(x)[8:28])


def test_a_refused_view_is_sliced_with_one_notice_even_under_warnings_as_errors(monkeypatch, caplog):
    """Where DLPack refuses, the rows are sliced instead and the call goes on: the refusal is logged once, not
    warned, so `-W error` cannot turn it into the call's failure."""

    def refuse(*args, **kwargs):
        raise RuntimeError("DLPack refused here")

    monkeypatch.setattr(row_views, "_import_rows", lambda *args: None)
    monkeypatch.setattr(jax.dlpack, "from_dlpack", refuse)
    x = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "vitjax.row_views"):
        warnings.simplefilter("error")
        views = [row_view(x, 8, 20), row_view(x, 8, 20), row_view(x, 0, 3)]
    for view, (start, rows) in zip(views, [(8, 20), (8, 20), (0, 3)], strict=True):
        np.testing.assert_array_equal(view, np.asarray(x)[start : start + rows])
    assert [r.getMessage() for r in caplog.records] == [
        "vitjax: zero-copy row views unavailable (DLPack refused here); slicing per image size instead"
    ]


def test_a_notice_met_by_many_threads_at_once_is_logged_once(caplog):
    """Row views are made on several engines' threads: a refusal they meet together is one log record."""
    start = threading.Barrier(8)

    def meet():
        start.wait()
        notice_once("vitjax.row_views", "the same refusal")

    with caplog.at_level(logging.WARNING, "vitjax.row_views"):
        threads = [threading.Thread(target=meet) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.getMessage() for r in caplog.records] == ["vitjax: the same refusal"]
