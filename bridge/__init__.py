"""SGLang integration for vitjax."""
