"""Requests exactly as the protocols' own documents give them, shared by unit and e2e tests."""

MINDIE_SEED_EXAMPLE = {  # mindie-v2-generate-stream.txt, single-modality request example
    "id": "a123",
    "text_input": "My name is Olivier and I",
    "parameters": {"details": True, "do_sample": True, "max_new_tokens": 20,
                   "repetition_penalty": 1.1, "seed": 123, "temperature": 1, "top_k": 10,
                   "top_p": 0.99, "batch_size": 100, "typical_p": 0.5, "watermark": False,
                   "perf_stat": False, "priority": 5, "timeout": 10},
}

# lmi-inference-api-schema.txt, rolling-batch request example (its trailing commas dropped)
LMI_SEED_REQUEST = {
    "inputs": "What is Deep Learning?",
    "parameters": {"do_sample": True, "max_new_tokens": 256, "details": True},
    "stream": True,
}
# ... and its jsonlines response example: three tokens, the last carrying text and details
LMI_SEED_STREAM_TOKENS = [
    {"id": 304, "text": "Deep ", "log_prob": -0.052432529628276825},
    {"id": 11157, "text": " Learning", "log_prob": -1.2865009307861328},
    {"id": 278, "text": " is", "log_prob": -0.007458459585905075},
]
LMI_SEED_STREAM_ERROR = {  # the seed's streaming error line (DJL adds token.error_msg)
    "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
    "generated_text": "",
    "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None},
}
LMI_SEED_ERROR = {  # the seed's non-streaming error body (the gateway adds error and code)
    "generated_text": "",
    "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None,
                "tokens": None},
}
