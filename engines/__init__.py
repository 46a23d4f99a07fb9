"""Engine integrations, one room per engine, each built on the client (``engine_client``) and never imported by it.

- ``engines.reference``: a transformers engine with tree attention, KV-cache upkeep and lossless verification
  (torch).
- ``engines.vllm``: drafter as vLLM's speculative proposer (``engines.vllm.DrafterProposer``).
"""
