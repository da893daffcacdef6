"""See `vllm/__init__.py`: imported by SGLang on the CPU, never called."""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("test stub: SGLang's CPU path must not call vllm's rotary kernel")
