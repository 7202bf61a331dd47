"""The ``vllm`` engine kind: vLLM v1 ``AsyncLLM`` (the CPU build or the GPU build alike).

Importing this package does not import vLLM; ``engines.vllm.engine`` does.
"""
