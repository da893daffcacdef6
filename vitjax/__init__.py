"""vitjax: the Qwen3-VL vision tower in JAX/XLA."""

from vitjax.config import VisionConfig
from vitjax.encoder import Encoded, Encoder
from vitjax.images import ImageInputError
from vitjax.video import Video, VideoInputError

__version__ = "0.1.0"
__all__ = ["Encoded", "Encoder", "ImageInputError", "Video", "VideoInputError", "VisionConfig", "__version__"]
