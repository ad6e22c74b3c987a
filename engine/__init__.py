"""The model engine the target and the model drafters share: config (device, dtype), llama (model math),
attention (paged-attention plan), linear_cpu (CPU matmul choice), kv_cache (paged KV blocks), runner (one
forward over a batch)."""
