"""fa4's Hopper forward with every row's softmax sum carried by P·V (imported only where fa4-jax is installed).

fa4 runs head_dim 72 as 80 inside its tile, so its P·V GEMM computes eight output columns that nothing uses. Given V
at the tile's width with ones in column `head_dim` (`attention.value_columns`), that output column is Σ P, and the
online rescale of O (O ← α·O + P·V) is exactly the row sum's own recurrence (l ← α·l + Σ P): the tensor cores keep
the sums, the softmax stops adding them (56 serial FADDs a thread for each step of 112 keys) and the epilogue divides
O by that column. The sums are those of P as rounded to bf16 for the GEMM, the same P the numerator is made of.

With the sums gone, a step's softmax is mostly its row maxima (56 FMNMX, the shuffles, the O rescale's 40 FMULs). With
`fixed_shift` each row's exponentials are shifted by its maximum over the first block fa4 visits (the sequence's last
keys), and later blocks are exponentiated against it with no maximum and no rescale: exact, since softmax does not
depend on the shift, while P stays finite. A row whose later scores pass that maximum by ~2^64 (its sum column past
`OVERFLOW`) is poisoned, O and log-sum-exp NaN, and `fa4.forward` runs the call again with the online maximum.

With `shift_column` too, q and k come at the tile's width, q scaled by head_dim**-0.5 · log2(e) and k with a one in
column `head_dim` (`attention.query_key_columns`): the first block writes each row's shift, negated and rounded to Q's
dtype, into that column of the Q tile in shared memory, so later blocks' Q·Kᵀ comes out already shifted and in log2
units, and a score's exponential is the MUFU alone (the FFMA of scale and shift goes: 56 a thread for each step).
Reaches into fa4-jax 0.1.0's kernel module (its `Softmax`, swapped while the MMA warpgroups' code is traced, and the
epilogue's signature): checked on `fa4.FA4_VERIFIED` only.
"""

from __future__ import annotations

import functools
import inspect
import operator

import cutlass
import cutlass.cute as cute
from fa4_jax.cute import flash_fwd_sm90, utils
from fa4_jax.cute.quack import layout_utils
from fa4_jax.cute.softmax import Softmax

from vitjax.fa4 import LN2

OVERFLOW = 2.0**64


class _SoftmaxWithoutSums(Softmax):
    """fa4's online softmax (row maxima, exponentials, the rescale factors) without the row sums; with `FIXED`, the
    first block's maxima (scaled) kept as the rows' shifts, and no maxima or rescale after it."""

    FIXED = False
    # With a shift column (set per trace by `forward_class`'s `mma`): the Q tile in shared memory, the column the shift
    # goes to, and this thread's (row, column) coordinates of a Q·Kᵀ accumulator.
    QUERY = None
    COLUMN = 0
    COORDINATES = None

    @classmethod
    def create(cls, scale_log2, num_rows, arch=80, softmax_scale=None):
        row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        return cls(scale_log2, num_rows, row_max, row_sum, arch, softmax_scale)

    @cute.jit
    def online_softmax(
        self, acc_S, is_first: cutlass.Constexpr[bool] = False, check_inf: cutlass.Constexpr[bool] = True
    ):
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        row_scale = cute.make_fragment_like(self.row_max, cutlass.Float32)
        for r in cutlass.range(cute.size(self.row_max), unroll_full=True):
            scores = acc_S_mn[r, None].load()
            if cutlass.const_expr(self.FIXED and not is_first):  # exponentials against the shift the first block set
                if cutlass.const_expr(self.QUERY is not None):  # Q·Kᵀ came shifted, in log2 units
                    shifted = scores
                else:
                    shifted = scores * self.scale_log2 - self.row_max[r]
                acc_S_mn[r, None].store(cute.math.exp2(shifted, fastmath=True))
                row_scale[r] = 1.0
            else:  # the row maxima: every block online, the first under a fixed shift
                init = None if cutlass.const_expr(is_first) else self.row_max[r]
                current = utils.fmax_reduce(scores, init_val=init, arch=self.arch)
                current = cute.arch.warp_reduction_max(current, threads_in_group=4)
                previous = self.row_max[r]
                self.row_max[r] = current
                if cutlass.const_expr(check_inf):
                    current = 0.0 if current == -cutlass.Float32.inf else current
                if cutlass.const_expr(self.QUERY is not None):  # the shift as Q will hold it, rounded to its dtype
                    shift = (-current).to(self.QUERY.element_type)
                    self.QUERY[self.COORDINATES[r, 0][0], self.COLUMN] = shift
                    self.row_max[r] = -shift.to(cutlass.Float32)
                    acc_S_mn[r, None].store(cute.math.exp2(scores - self.row_max[r], fastmath=True))
                else:
                    if cutlass.const_expr(self.FIXED):
                        self.row_max[r] = current * self.scale_log2
                    acc_S_mn[r, None].store(
                        cute.math.exp2(scores * self.scale_log2 - current * self.scale_log2, fastmath=True)
                    )
                if cutlass.const_expr(is_first):
                    row_scale[r] = 1.0
                else:
                    row_scale[r] = cute.math.exp2((previous - current) * self.scale_log2, fastmath=True)
        if cutlass.const_expr(self.QUERY is not None and is_first):
            # each warp's wgmma reads the Q rows it holds (as fa4 relies on for P): fence, then the warp's own barrier
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()
        return row_scale

    @cute.jit
    def rescale_O(self, acc_O, row_scale) -> None:
        if cutlass.const_expr(not self.FIXED):
            acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
            for r in cutlass.range(cute.size(row_scale), unroll_full=True):
                acc_O_mn[r, None].store(acc_O_mn[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, final_scale: cutlass.Float32 = 1.0, sink_val=None):
        """O is divided by its sums in the epilogue; `row_sum` hands it each row's scaled maximum for the LSE."""
        row_scale = cute.make_fragment_like(self.row_max, cutlass.Float32)
        row_scale.fill(final_scale)
        for r in cutlass.range(cute.size(self.row_max), unroll_full=True):
            self.row_sum[r] = self.row_max[r] if cutlass.const_expr(self.FIXED) else self.row_max[r] * self.scale_log2
        return row_scale


class _FixedShiftSoftmax(_SoftmaxWithoutSums):
    FIXED = True


@functools.cache
def forward_class(head_dim: int, fixed_shift: bool = False, shift_column: bool = False) -> type:
    """`FlashAttentionForwardSm90` for V at the tile's width with its sum column at `head_dim` (a multiple of 8), q and
    k at `head_dim` or, the call's choice, at the tile's width; `fixed_shift`: the rows' shifts fixed by their first
    block; `shift_column` (with it, q and k at the tile's width): written into Q's column `head_dim` (module
    docstring)."""
    base = flash_fwd_sm90.FlashAttentionForwardSm90
    softmax = _FixedShiftSoftmax if fixed_shift else _SoftmaxWithoutSums
    signature = inspect.signature(base.mma)
    # In a thread's (rows, columns) view of a wgmma accumulator, local columns 2j and 2j + 1 are global columns
    # 8j + 2·(lane % 4) + (0, 1): local 2·head_dim/8 and the next cover columns head_dim .. head_dim + 7 over a quad of
    # lanes, the sum column and zeros.
    column = head_dim // 8 * 2

    class SumsByTensorCores(base):
        def mma(self, *args, **kwargs):
            flash_fwd_sm90.Softmax = softmax
            if shift_column:
                given = signature.bind(self, *args, **kwargs).arguments
                thread = given["tiled_mma_qk"].get_slice(given["tidx"])
                scores = cute.make_identity_tensor((self.tile_m, self.tile_n))
                coordinates = layout_utils.reshape_acc_to_mn(thread.partition_C(scores))
                fields = {"QUERY": given["sQ"], "COLUMN": head_dim, "COORDINATES": coordinates}
                flash_fwd_sm90.Softmax = type("ColumnShiftSoftmax", (softmax,), fields)
            try:
                return base.mma(self, *args, **kwargs)
            finally:
                flash_fwd_sm90.Softmax = Softmax

        @cute.jit
        def epilogue(self, acc_O, lse, mO, mLSE, *rest):
            """Divide O by its sum column (and finish the LSE where one is written), then fa4's epilogue."""
            acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
            for r in cutlass.range(cute.size(acc_O_mn, mode=[0]), unroll_full=True):
                total = utils.warp_reduce(acc_O_mn[r, column] + acc_O_mn[r, column + 1], operator.add, width=4)
                empty = total == 0.0 or total != total  # a padding row: left as fa4 leaves it
                if cutlass.const_expr(fixed_shift):  # a score far past the first block's maximum: poison the row
                    total = total if total < OVERFLOW else cutlass.Float32.nan
                scale = cute.arch.rcp_approx(total if not empty else 1.0)
                acc_O_mn[r, None].store(acc_O_mn[r, None].load() * scale)
                if cutlass.const_expr(mLSE is not None):  # fa4's log-sum-exp, from the scaled maximum `finalize` left
                    lse[r] = (
                        (lse[r] + cute.math.log2(total, fastmath=True)) * LN2 if not empty else -cutlass.Float32.inf
                    )
            base.epilogue(self, acc_O, lse, mO, mLSE, *rest)

    return SumsByTensorCores
