"""The bundled engine's model side: config, tokenizer, checkpoint loading, KV cache, Llama."""
