"""Target service: runs the large model that verifies draft tokens."""
