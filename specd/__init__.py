"""specd: speculative-decoding LLM serving as async gRPC microservices.

This shared package holds what every service and the CLI use: domain types,
errors, limits and defaults, the server bootstrap, model resolution and the
client. It imports no service; the CLI (specd_cli/) is the layer above them.
"""
