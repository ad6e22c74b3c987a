"""Lookahead (Jacobi) decoding inside the target: LookaheadDecoding (Fu et al., 2024) and MindIE's lookahead.

Each sequence keeps a 2-D window of guessed tokens, `level - 1` levels of `window` columns, that rides in
the target's own forward beside the sequence's draft. Column j of level 0 guesses the token j + 1 places
past the sequence's newest token, and each level above it one place further: the token at (l, j)
follows, in the forward's tree, the level-0 tokens up to column j and then column j's levels below l,
so its argmax is the next Jacobi iterate at depth l + j + 2. After a step, column j's tokens up the
levels and the argmax over the top one are an n-gram of `level` tokens; it joins a pool keyed by its
first token (the `guess_set_size` latest per key). The window then moves up a level: the lowest goes,
the argmaxes over the top form the new top (while fewer than `level - 1` levels are filled, they are
added). The pool also takes the n-grams of the sequence's own text, prompt and output, as they are
committed (LookaheadDecoding's pool from the prompt).

A step's draft is the pool's n-grams that follow the sequence's newest token, merged into one tree
(shared prefixes once), best first. It is verified like any draft, so lookahead is lossless for
greedy and sampled requests alike: the window's guesses only decide what is drafted.

The window is ~(level - 1) × window extra tokens per step. Its worth is what it adds: the accepted draft
tokens its n-grams bring (counted when accepted, whenever that is) per step it ran; the target's cost
model weighs that against the window's price at the current load and runs it only where it pays. A
sequence that has not shown its window's worth yet is expected to yield what windows have yielded the
deployment's sequences lately (PRIOR_YIELD before any has run): with a fixed prior, every new sequence
ran its window on its first asks whatever windows had been bringing, and under `auto`, which asks
lookahead now and then for every sequence, those windows (15 tokens on a 12 ms CPU step, ~40 ms steps)
cost it more than lookahead's drafts brought.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from specd.drafts import ROOT, DraftTree
from specd.options import Option, OptionSchema
from target_svc.drafting.base import Window
from target_svc.sequence import Sequence

METHOD = "lookahead"
SCHEMA = OptionSchema(METHOD, (
    Option("lookahead_level", "int", 4, 3, 16, help="N: the n-grams' length; the window has N - 1 levels"),
    Option("lookahead_window", "int", 5, 1, 16, help="W: the window's columns (Jacobi guesses per level)"),
    Option("lookahead_guess_set_size", "int", 5, 1, 16,
           help="G: n-grams kept per first token, and so verified at most per step"),
))
# A draft token's estimated acceptance, split among siblings by how many n-grams pass through each:
# the target's calibration scales it to what lookahead's drafts achieve.
ACCEPTANCE_ESTIMATE = 0.5
# What the window is expected to bring per step before any has run on the deployment: worth trying where
# its tokens are cheap (a GPU at low load), not where they cost a step's worth (a loaded CPU).
PRIOR_YIELD = 1.0
PRIOR_STEPS = 2.0  # the prior's weight, in window steps
RECENT_STEPS = 16  # a sequence's window yield is a mean over about this many of its steps
DEPLOYMENT_RECENT_STEPS = 256  # the deployment's, over about this many steps of its sequences


@dataclass
class _WindowYield:
    """Draft tokens the window's n-grams brought, per step the window ran, over about `recent_steps` steps."""
    recent_steps: int = RECENT_STEPS
    accepted: float = 0.0
    window_steps: float = 0.0

    def expected(self, prior: float) -> float:
        return (self.accepted + prior * PRIOR_STEPS) / (self.window_steps + PRIOR_STEPS)

    def step(self, window_ran: bool, accepted_from_window: int) -> None:
        keep = 1.0 - 1.0 / self.recent_steps
        self.accepted = self.accepted * keep + accepted_from_window
        self.window_steps = self.window_steps * keep + window_ran


@dataclass
class _Lookahead:
    """One sequence's window, n-gram pool and the yield of its window."""
    level: int
    width: int
    guess_set_size: int
    levels: list[list[int]]  # levels[l][j]: the guess at level l, column j
    # first token -> the (level - 1)-token continuations seen after it, oldest first, each marked True
    # if the window guessed it (and not the text)
    pool: dict[int, OrderedDict[tuple[int, ...], bool]] = field(default_factory=dict)
    indexed: int = 0  # the sequence's tokens whose n-grams are in the pool
    last_draft_from_window: tuple[bool, ...] = ()  # per node of the latest draft
    yield_: _WindowYield = field(default_factory=_WindowYield)

    def remember(self, ngram: tuple[int, ...], from_window: bool) -> None:
        continuations = self.pool.setdefault(ngram[0], OrderedDict())
        rest = ngram[1:]
        continuations[rest] = continuations.pop(rest, True) and from_window  # a guess until the text has it
        if len(continuations) > self.guess_set_size:  # the oldest guess goes first: the text's n-grams happened
            guesses = [key for key, guessed in continuations.items() if guessed]
            del continuations[guesses[0] if guesses else next(iter(continuations))]

    def index_text(self, tokens: list[int]) -> None:
        """The n-grams of the sequence's committed tokens not yet in the pool."""
        for end in range(max(self.indexed, self.level), len(tokens) + 1):
            self.remember(tuple(tokens[end - self.level:end]), from_window=False)
        self.indexed = len(tokens)

    def draft(self, last_token: int, k: int) -> DraftTree:
        """The pool's continuations of `last_token`, newest first, merged into a tree of at most k nodes."""
        candidates = list(reversed(self.pool.get(last_token, {}).items()))
        nodes: dict[tuple[int, ...], list] = {}  # path -> [token, parent path, n-grams through it, from window]
        for continuation, from_window in candidates:
            for depth in range(1, len(continuation) + 1):
                node = nodes.setdefault(continuation[:depth], [continuation[depth - 1], continuation[:depth - 1], 0,
                                                               False])
                node[2] += 1
                node[3] = node[3] or from_window
        reach = {(): 1.0}
        for path, (_, parent, count, _) in nodes.items():  # parents come first: paths were added shortest first
            share = count / (nodes[parent][2] if parent else len(candidates))
            reach[path] = reach[parent] * ACCEPTANCE_ESTIMATE * share
        order = sorted(nodes, key=lambda path: (-reach[path], len(path)))[:k]  # a parent reaches at least as far
        index = {path: i for i, path in enumerate(order)}
        tree = DraftTree(tuple(nodes[p][0] for p in order),
                         tuple(index[p[:-1]] if len(p) > 1 else ROOT for p in order),
                         tuple(reach[p] / reach[p[:-1]] for p in order))
        self.last_draft_from_window = tuple(nodes[p][3] for p in order)
        return tree

    def window(self, prior_yield: float) -> Window:
        """The levels as a tree: level 0 a chain from the newest token, each higher token a child of the
        one below it in its column; the top level's nodes are the guesses. `prior_yield`: what it is
        expected to bring a step before this sequence has shown it."""
        width, parents = self.width, []
        for level in range(len(self.levels)):
            for column in range(width):
                parents.append((column - 1 if column else ROOT) if level == 0 else (level - 1) * width + column)
        top = (len(self.levels) - 1) * width
        return Window(tuple(t for tokens in self.levels for t in tokens), tuple(parents),
                      tuple(range(top, top + width)), self.yield_.expected(prior_yield))

    def advance(self, guesses: list[int]) -> None:
        """The target's argmax over the top level: the columns' n-grams join the pool, and the window
        moves up a level (or grows one, until it has level - 1)."""
        if len(self.levels) < self.level - 1:
            self.levels.append(guesses)
            return
        for column, guess in enumerate(guesses):
            self.remember((*(tokens[column] for tokens in self.levels), guess), from_window=True)
        self.levels = [*self.levels[1:], guesses]


class LookaheadSource:
    """The in-target `lookahead` method: a window and a pool per sequence."""

    method = METHOD
    schema = SCHEMA

    def __init__(self):
        self._states: dict[str, _Lookahead] = {}
        self._deployment_yield = _WindowYield(DEPLOYMENT_RECENT_STEPS)  # every sequence's window steps

    async def start(self) -> None:
        pass

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree]:
        drafts = {}
        for seq, k in wanted:
            state = self._state(seq)
            state.index_text(seq.tokens)
            if draft := state.draft(seq.tokens[-1], k):
                drafts[seq.request_id] = draft
        return drafts

    def window(self, seq: Sequence) -> Window | None:
        state = self._states.get(seq.request_id)
        return state.window(self._deployment_yield.expected(PRIOR_YIELD)) if state is not None else None

    def observe(self, seq: Sequence, guesses: list[int], num_verified: int, accepted_nodes: tuple[int, ...]) -> None:
        state = self._states.get(seq.request_id)
        if state is None:
            return
        from_window = state.last_draft_from_window
        brought = sum(from_window[node] for node in accepted_nodes if node < len(from_window))
        for record in (state.yield_, self._deployment_yield):
            record.step(bool(guesses), brought)
        state.last_draft_from_window = ()
        if guesses:
            state.advance(guesses)

    def _state(self, seq: Sequence) -> _Lookahead:
        state = self._states.get(seq.request_id)
        if state is None:
            # Under `method: auto` the request carries no lookahead options: the defaults hold.
            level, width, guess_set_size = (int(seq.speculative.options.get(option.name, option.default))
                                            for option in SCHEMA.options)
            # The first level: tokens from the sequence's own text, in random order (as LookaheadDecoding),
            # seeded by it so that a rerun drafts alike.
            pick = random.Random(len(seq.tokens))
            state = _Lookahead(level, width, guess_set_size, [[pick.choice(seq.tokens) for _ in range(width)]])
            self._states[seq.request_id] = state
        return state

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.request_id, None)

    async def close(self) -> None:
        self._states.clear()
