"""Deployment defaults that more than one layer needs (a service and the CLI's flags)."""

# Seconds in-flight streams get to finish after SIGTERM. The deployment files give a container
# 15 s between SIGTERM and SIGKILL; this leaves the rest for closing channels and flushing.
SHUTDOWN_GRACE_S = 10.0

# Gateway: the longest a request may run end to end unless the client's own deadline is sooner.
UPSTREAM_TIMEOUT_S = 600.0

# Drafter: bounds of the per-sequence state, for when the target's Release never arrives.
DRAFTER_MAX_SEQUENCES = 4096
DRAFTER_MAX_TOKENS_HELD = 1_000_000  # ~0.7 GB of RSS with the n-gram index over them (measured)
DRAFTER_IDLE_TIMEOUT_S = 300.0
