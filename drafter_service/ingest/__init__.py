"""Bringing completed requests in: warm from request logs, corpus reading and frozen-table builds.

Modules: ``warm`` (``Warmer``), ``warm_sinks`` (into a service in process or over gRPC), ``warm_state``
(checkpoints), ``warm_watch`` (a folder watched by ``serve --warm-dir``), ``log_reader`` (token-id, text and chat
lines), ``text_tokenizer``, ``corpus_reader`` and ``corpus_build`` (``drafter import-corpus``). Import them
directly: most callers need one, and the tokenizer loads the ``tokenizers`` library.
"""
