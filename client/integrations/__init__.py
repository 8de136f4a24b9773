"""Engine integrations: Hugging Face transformers (`hf`) and vLLM (`vllm`)."""
