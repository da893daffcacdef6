"""SGLang's external model package for vitjax (`SGLANG_EXTERNAL_MODEL_PACKAGE=bridge.sglang_models`).

SGLang's registry imports every module here in every process, tokenizer included: the modules import
SGLang's model code and nothing of JAX until a model is built.
"""
