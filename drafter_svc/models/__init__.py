"""The model drafters' torch side (draft LM, KV bookkeeping), imported only by a drafter that serves a
model, so the CPU drafters and the CLI start without torch."""
