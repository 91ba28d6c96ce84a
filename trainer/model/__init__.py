"""The model floor: the decoder, its sharding rules, the decode kernel, LoRA adapters, Hugging Face weights and the
tokenizer. Imports only trainer.base below it (docs/architecture.md)."""
