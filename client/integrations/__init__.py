"""Engine integrations: Hugging Face transformers (`hf`), vLLM (`vllm`, and `disagg_proxy` for
its disaggregated prefill over HTTP) and SGLang (`sglang`)."""
