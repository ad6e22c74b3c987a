"""Gateway: the public Generation service (tokenize, validate, stream text deltas); no model code."""
