"""Generation on vLLM: samples with token ids, per-token logprobs and finish reasons."""
