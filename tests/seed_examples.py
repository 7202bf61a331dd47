"""Requests copied verbatim from the protocol seeds (shared/seeds), shared by unit and e2e tests."""

MINDIE_SEED_EXAMPLE = {  # mindie-v2-generate-stream.txt, single-modality request example
    "id": "a123",
    "text_input": "My name is Olivier and I",
    "parameters": {"details": True, "do_sample": True, "max_new_tokens": 20,
                   "repetition_penalty": 1.1, "seed": 123, "temperature": 1, "top_k": 10,
                   "top_p": 0.99, "batch_size": 100, "typical_p": 0.5, "watermark": False,
                   "perf_stat": False, "priority": 5, "timeout": 10},
}
