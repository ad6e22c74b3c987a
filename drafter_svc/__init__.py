"""Drafter service: proposes draft tokens for many sequences at once (CPU drafters: n-gram prompt lookup)."""
