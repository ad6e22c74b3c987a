"""The target service's Prometheus metrics, on a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.latency import LATENCY_BUCKETS
from specd.rpc import RpcMetrics

_FAST_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)


class TargetMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rpc_metrics = RpcMetrics(r)
        self.requests_running = Gauge("specd_requests_running",
                                      "Sequences in the running batch (being prefilled or decoded)", registry=r)
        self.requests_waiting = Gauge("specd_requests_waiting",
                                      "Sequences queued for admission into the running batch", registry=r)
        self.requests_finished = Counter("specd_requests_finished",
                                         "Finished sequences, by finish reason (stop, length, aborted, stuck, error)",
                                         ["reason"], registry=r)
        self.requests_rejected = Counter(
            "specd_requests_rejected",
            "Requests refused with RESOURCE_EXHAUSTED because the waiting queue was full (--max-waiting)", registry=r)
        self.preemptions = Counter(
            "specd_preemptions",
            "Running sequences whose KV blocks were taken back when the cache ran out; each is recomputed "
            "from its tokens later, its output unchanged", registry=r)
        self.drafting_skipped = Counter(
            "specd_drafting_skipped_steps",
            "Steps in which sequences could take drafts but the drafters were not asked: by what the drafts "
            "had been gaining, their round trip would have cost more", registry=r)
        self.ask_overhang = Gauge(
            "specd_drafter_ask_overhang_seconds",
            "What asking a drafter costs a step beyond its round trip, by method: how much further the steps "
            "that asked it ran over the cost model's prediction than the steps that could have asked and did not (the drafter's "
            "own work on the target's cores); added to the round trip when deciding whether to ask",
            ["method"], registry=r)
        self.auto_choices = Counter(
            "specd_auto_method_choices",
            "Drafter asks for `method: auto` sequences, by the drafter chosen and why: trial (each is tried in "
            "turn first), best (what has gained the sequence most), batch (the drafter most of the step's auto "
            "sequences chose, in place of this one's best: one drafter a step), shadow (asked beside the best one, "
            "its draft scored against the tokens that followed, not verified)",
            ["method", "reason"], registry=r)
        self.window_tokens = Counter(
            "specd_window_tokens",
            "Tokens of in-target windows (lookahead's Jacobi guesses) that rode in the steps' forwards, by "
            "whether the cost model ran the window: ran, or skipped (it would not have paid at that load)",
            ["outcome"], registry=r)
        self.prefill_chunks = Counter(
            "specd_prefill_chunks",
            "Prompt pieces prefilled in a step without completing the prompt (chunked prefill: "
            "--max-step-tokens, or the KV blocks free)", registry=r)
        self.step_draft_tokens = Histogram(
            "specd_step_draft_tokens",
            "Draft tokens one step verifies, the whole batch: those the cost model expects to raise goodput",
            registry=r, buckets=(0, 1, 4, 16, 64, 256, 1024))
        self.predicted_step_tokens = Counter(
            "specd_predicted_step_tokens",
            "Tokens the cost model expected the steps' decodes to yield (1 + the reach of each draft token "
            "kept); next to specd_realized_step_tokens_total", registry=r)
        self.realized_step_tokens = Counter(
            "specd_realized_step_tokens", "Tokens the steps' decodes yielded (1 + accepted draft tokens each)",
            registry=r)
        self.predicted_step_seconds = Counter(
            "specd_predicted_step_seconds", "Seconds the cost model predicted the steps would take; next to "
            "specd_realized_step_seconds_total", registry=r)
        self.realized_step_seconds = Counter("specd_realized_step_seconds", "Seconds the steps took (forward "
                                             "and verification)", registry=r)
        self.step_stuck = Gauge("specd_step_stuck",
                                "1 while a step has run over --step-timeout (the target reports NOT_SERVING and "
                                "fails the requests waiting on it with DEADLINE_EXCEEDED), else 0", registry=r)
        self.stuck_steps = Counter("specd_stuck_steps", "Steps that ran over --step-timeout", registry=r)
        self.step_cost = Gauge("specd_step_cost_seconds",
                               "The fitted step cost model: seconds fixed, per new token and per token "
                               "of the sequences' lengths; fit=online (steps' seconds) or profile (what draft "
                               "tokens are priced by)", ["term", "fit"], registry=r)
        self.step_host = Gauge("specd_step_host_seconds",
                               "What a step takes besides its forward and the drafters' round trip (planning, "
                               "committing, streaming), a moving mean; part of the plain step drafts are weighed "
                               "against", registry=r)
        self.queue_time = Histogram("specd_request_queue_time_seconds",
                                    "Seconds from a request's arrival to its admission into the running batch",
                                    registry=r, buckets=LATENCY_BUCKETS)
        self.time_to_first_token = Histogram("specd_time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first output token, by method",
                                             ["method"], registry=r, buckets=LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(
            "specd_inter_token_latency_seconds",
            "Seconds between consecutive output tokens, by method (a step's gap divided by the tokens it produced)",
            ["method"], registry=r, buckets=LATENCY_BUCKETS)
        self.e2e_latency = Histogram("specd_e2e_request_latency_seconds",
                                     "Seconds from a request's arrival to its last output token, by method",
                                     ["method"], registry=r, buckets=LATENCY_BUCKETS)
        self.draft_tokens = Counter("specd_draft_tokens", "Draft tokens the target verified, by method",
                                    ["method"], registry=r)
        self.accepted_tokens = Counter(
            "specd_accepted_tokens",
            "Draft tokens the target accepted, by method; acceptance rate = accepted / draft tokens",
            ["method"], registry=r)
        self.draft_tokens_per_position = Counter(
            "specd_draft_tokens_per_position",
            "Draft tokens verified at each 0-based draft position, by method; accepted / draft at a position "
            "is that position's acceptance rate",
            ["method", "position"], registry=r)
        self.accepted_per_position = Counter(
            "specd_accepted_tokens_per_position",
            "Draft tokens accepted at each 0-based draft position, by method; per verification step, "
            "the share of steps whose draft was kept up to that position",
            ["method", "position"], registry=r)
        self.verification_steps = Counter(
            "specd_verification_steps",
            "Decode steps, once per sequence per step (prefill excluded), by method; "
            "mean acceptance length = 1 + accepted tokens / verification steps",
            ["method"], registry=r)
        self.output_tokens = Counter("specd_output_tokens",
                                     "Tokens generated (the prefill's first token included), by method",
                                     ["method"], registry=r)
        self.step_batch_size = Histogram("specd_step_batch_size",
                                         "Sequences in one forward pass of the target (prefills plus decodes)",
                                         registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.step_tokens = Histogram(
            "specd_step_tokens",
            "Tokens in one forward pass: prompts being prefilled plus each decode's last token and draft",
            registry=r, buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384))
        self.forward_time = Histogram("specd_forward_seconds",
                                      "Seconds of one target step on the worker thread: the batched forward pass "
                                      "plus verification", registry=r, buckets=LATENCY_BUCKETS)
        self.kv_blocks_used = Gauge("specd_kv_cache_blocks_used", "KV cache blocks holding tokens of running sequences",
                                    registry=r)
        self.kv_blocks_total = Gauge("specd_kv_cache_blocks_total",
                                     "KV cache blocks in the pool; usage = used / total", registry=r)
        self.kv_bytes_per_token = Gauge("specd_kv_cache_bytes_per_token",
                                        "Bytes of KV cache one token takes (K and V, every layer, in the engine's dtype)",
                                        registry=r)
        self.kv_tokens_total = Gauge("specd_kv_cache_tokens_total", "Tokens the KV cache holds at most", registry=r)
        self.engine_info = Gauge("specd_engine_info",
                                 "The device and dtype the model runs in, its attention kernel, and whether "
                                 "its logits are batch invariant (value 1)",
                                 ["device", "dtype", "attention", "batch_invariant"], registry=r)
        self.drafter_rpc_latency = Histogram(
            "specd_drafter_rpc_seconds",
            "Seconds of one batched Propose RPC to a drafter service, failed ones included, by method",
            ["method"], registry=r, buckets=_FAST_BUCKETS)
        self.drafter_failures = Counter(
            "specd_drafter_rpc_failures",
            "Propose RPCs that failed, so the step went on draft-free, by method and code: a gRPC status "
            "(DEADLINE_EXCEEDED = missed --drafter-timeout-ms) or MALFORMED (wrong number of drafts)",
            ["method", "code"], registry=r)
