"""interpreted/ holds tests that need TRITON_INTERPRET=1 from process start; only the
subprocess that test_triton_interpreter.py starts sets it, and only it collects them."""
import os

collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]
