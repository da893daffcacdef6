"""vitjax: the Qwen3-VL vision tower in JAX/XLA."""

from vitjax.config import VisionConfig
from vitjax.encoder import Encoder

__version__ = "0.1.0"
__all__ = ["Encoder", "VisionConfig", "__version__"]
