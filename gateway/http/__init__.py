"""The gateway's OpenAI-compatible HTTP API, beside its gRPC one, over the same GenerationPipeline."""
