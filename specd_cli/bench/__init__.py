"""`specd bench`: Spec-Bench and serving-load benchmarks of a running specd stack,
side by side with transformers' own decoding as the baseline a user would pick."""
