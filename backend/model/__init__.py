"""The engine's model side: config, checkpoint loading, tokenizers, detokenization, chat
templates, RoPE, KV cache and the Llama-family decoder (Llama, Mistral, Qwen2)."""
