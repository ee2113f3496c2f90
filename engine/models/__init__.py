"""Models as Hugging Face directories: loading policies, reward and value models and tokenizers,
LoRA adapters, the chunked LM head for log-probs, token roles (stop and pad ids), GGUF import.

Owns: loading, identity (fingerprints), lora, lm_head, tokens, gguf, importing.
May import: engine.config, engine.algorithms, engine.errors.
"""
