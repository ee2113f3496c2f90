"""A valid generate request's fields, for the rollout worker tests."""

REQUEST = {
    "prompts": [[5, 6, 7], [8]],
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 6,
    "seed": 2,
    "stop_token_ids": [0],
    "pad_token_id": 0,
}
