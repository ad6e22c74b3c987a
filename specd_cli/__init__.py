"""The layer above the services: the `specd` command (main.py) and what it runs besides them,
`specd up` (stack.py), `specd top` (top.py) and `specd bench` (bench/, needs the `bench` extra)."""
import os

# torch's CPU threads (libgomp) spin for ~10 ms after each parallel region before they sleep (GOMP_SPINCOUNT's
# default, 300000). A target that spins after its forward holds a core its drafters and its event loop need
# meanwhile, and a model drafter that spins after answering slows the target's next forward: with the EAGLE
# drafter at batch 1 (bf16, 2-core EPYC) its asks cost the target's next forward 2.0 ms more, and their round
# trip was 9.6 ms, against 0.2 ms and 6.4 ms at 10000 spins (~0.5 ms), which still bridge the gaps between one
# forward's ops. Set here, before any of specd imports torch (and so loads libgomp); the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
