"""torch <-> JAX without copies (DLPack), and checkpoint tensors -> numpy.

Checked on torch 2.14.1 + JAX 0.10.2 (CPU) and torch 2.11 + JAX 0.11.2 (CUDA 13): both directions share
the buffer (bf16 included). On CUDA the producer's pending work must be done before the consumer reads:
torch's stream is synchronised before JAX reads a tensor, and a JAX result is ready before torch gets it.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import torch


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A torch tensor as a JAX array on the same device, sharing its memory."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array: jax.Array) -> torch.Tensor:
    """A (ready) JAX array as a torch tensor on the same device, sharing its memory."""
    return torch.from_dlpack(jax.block_until_ready(array))


# torch dtypes numpy has no type of its own for, as ml_dtypes' (same bits): vitjax's checks then name such a tensor
# (an FP8 checkpoint's quantized weights) where `tensor.numpy()` would raise a TypeError naming nothing.
_ML_DTYPES = {
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU checkpoint tensor as numpy (bf16 and FP8 as ml_dtypes' types), without a copy where possible."""
    tensor = tensor.detach().cpu()
    if tensor.dtype in _ML_DTYPES:
        same_width = torch.int16 if tensor.dtype == torch.bfloat16 else torch.uint8
        return tensor.view(same_width).numpy().view(_ML_DTYPES[tensor.dtype])
    return tensor.numpy()
