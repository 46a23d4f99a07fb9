"""Benchmark data and the target model: data set loaders, SmolLM2 weights and tokenizer, the local cache."""
