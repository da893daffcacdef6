"""SGLang's external multimodal processor package for vitjax
(`SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=bridge.sglang_processors`): it runs in SGLang's tokenizer process."""
