"""Test-only stand-in for vllm (never installed, never in the package): SGLang 0.5.23 imports
`vllm._custom_ops` when it builds rotary embeddings without a GPU; on the CPU path it never calls it."""
