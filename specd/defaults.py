"""Deployment defaults that more than one layer needs (a service and the CLI's flags)."""

# Where each service listens unless told otherwise: its gRPC API and its Prometheus /metrics, on loopback.
# `specd serve`, `specd up`, `specd top` and the client use these; docker-compose.yml publishes the same
# ports (tests/deploy/test_compose.py holds the two together).
GATEWAY_ADDRESS = "127.0.0.1:50051"
GATEWAY_METRICS_ADDRESS = "127.0.0.1:9100"
# The gateway's OpenAI-compatible HTTP API (vLLM's and SGLang's servers default to port 8000 too).
GATEWAY_HTTP_ADDRESS = "127.0.0.1:8000"
TARGET_ADDRESS = "127.0.0.1:50052"
TARGET_METRICS_ADDRESS = "127.0.0.1:9101"
DRAFTER_ADDRESS = "127.0.0.1:50061"
DRAFTER_METRICS_ADDRESS = "127.0.0.1:9102"

# Seconds in-flight streams get to finish after SIGTERM. The deployment files give a container
# 15 s between SIGTERM and SIGKILL; this leaves the rest for closing channels and flushing.
SHUTDOWN_GRACE_S = 10.0

# Gateway: the longest a request may run end to end unless the client's own deadline is sooner.
UPSTREAM_TIMEOUT_S = 600.0

# Drafter: bounds of the per-sequence state, for when the target's Release never arrives.
DRAFTER_MAX_SEQUENCES = 4096
DRAFTER_MAX_TOKENS_HELD = 1_000_000  # ~0.7 GB of RSS with the n-gram index over them (measured)
DRAFTER_IDLE_TIMEOUT_S = 300.0

# Target scheduling: the most tokens in one forward pass (decodes and drafts first, then prompt chunks),
# and the most requests queued for admission before new ones get RESOURCE_EXHAUSTED.
MAX_STEP_TOKENS = 2048
MAX_WAITING = 1024
# Target: a step's forward and verification still running after this long is stuck (a deadlock, a hung
# device): its requests and those waiting get DEADLINE_EXCEEDED and the target reports NOT_SERVING until
# it ends. Far above a real step (a full --max-step-tokens prefill on a small CPU takes seconds).
STEP_TIMEOUT_S = 30.0
