"""Training on DeepSpeed (ZeRO-1/2/3): token logprobs, policy losses, optimizer steps."""
