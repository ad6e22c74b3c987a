"""specd: speculative-decoding LLM serving as async gRPC microservices.

This shared package holds what every service and the CLI use: domain types,
the server bootstrap, model resolution, the client and the CLI.
"""
