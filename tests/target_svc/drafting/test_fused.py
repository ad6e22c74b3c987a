"""`method: fused`: the deployment's drafters asked together, their drafts merged into one tree; greedy
output never changes, and a path only one drafter knew is accepted all the same."""
import asyncio
import time

from specd.drafts import DraftTree
from specd.options import OptionSchema
from specd.types import SamplingParams, SpeculativeConfig
from target_svc.drafting.drafters import Drafters
from target_svc.drafting.fused import FusedSource
from target_svc.drafting.lookahead import LookaheadSource
from target_svc.sequence import Sequence
from tests.target_svc.drafting.test_lookahead import cost_model
from tests.target_svc.test_scheduler import Oracle, bf16_scheduler, prompt_of, run_to_end, sequence


class HalfOracle(Oracle):
    """Knows the reference continuation on even (or odd) output positions only: alone, it drafts one right
    token a step at best; the other half's drafts are wrong."""

    def __init__(self, method: str, parity: int, outputs: dict[str, list[int]]):
        super().__init__(outputs)
        self.method, self.parity, self.released = method, parity, set()

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree]:
        drafts = {}
        for seq, k in wanted:
            right = self.outputs[seq.request_id][seq.num_output:seq.num_output + k]
            if right:
                guess = right if seq.num_output % 2 == self.parity else [(t + 1) % 64 for t in right]
                drafts[seq.request_id] = DraftTree.chain(guess, [0.5] * len(guess))
        return drafts

    def release(self, sequence: Sequence) -> None:
        self.released.add(sequence.request_id)


PROMPTS = {f"f{i}": prompt_of(70 + i, 9 + 4 * i) for i in range(3)}


async def test_fused_drafts_merge_every_drafters_guesses_and_change_no_greedy_output(tiny_model_dir):
    async with bf16_scheduler(tiny_model_dir) as scheduler:
        expected = dict(zip(PROMPTS, await asyncio.gather(
            *(run_to_end(scheduler, sequence(name, p, max_tokens=24)) for name, p in PROMPTS.items()))))
    even, odd = HalfOracle("even", 0, expected), HalfOracle("odd", 1, expected)
    # Draft tokens priced at next to nothing: every draft is verified whole, whatever this machine's timings.
    async with bf16_scheduler(tiny_model_dir, sources=[even, odd], cost_model=cost_model(1e-6)) as scheduler:
        await scheduler._drafters.start()
        assert "fused" in scheduler._drafters.methods
        fused = SpeculativeConfig(method="fused", num_speculative_tokens=6)
        seqs = [Sequence(name, p, SamplingParams(max_tokens=24), fused, 24, eos_token_ids=frozenset())
                for name, p in PROMPTS.items()]
        got = dict(zip(PROMPTS, await asyncio.gather(*(run_to_end(scheduler, s) for s in seqs))))
        assert got == expected
        # whichever half is right this step, its path is in the merged tree: most steps accept several tokens
        assert sum(s.usage.verification_steps for s in seqs) < sum(len(t) for t in got.values()) / 2
        assert even.released == odd.released == set(PROMPTS)  # fused releases its members


async def test_only_drafters_of_tokens_alone_are_fused_and_one_alone_is_not():
    lone = Drafters([LookaheadSource()], vocab_size=64)
    await lone.start()
    assert "fused" not in lone.methods


async def test_a_member_with_a_window_learns_from_its_own_nodes_of_the_merged_draft():
    lookahead, other = LookaheadSource(), HalfOracle("even", 0, {"s": [9, 9, 9, 9]})
    fused = FusedSource([other, lookahead])
    seq = sequence("s", prompt=[1, 2, 3, 4, 1, 2, 3])  # lookahead's pool drafts 4 after 3 (the text's n-gram)
    merged = (await fused.propose([(seq, 8)]))["s"]
    state = lookahead._states["s"]
    state.last_draft_from_window = (True,) * 3  # as if its n-grams had come from its window
    fused.observe(seq, [5] * 5, num_verified=len(merged), accepted_nodes=(merged.token_ids.index(4),))
    assert state.yield_.accepted == 1  # credited with its node, under its own index
    assert state.levels[-1] == [5] * 5  # and its window advanced


class Constant:
    """Always drafts the same one token with the same estimate."""

    schema = OptionSchema("constant")

    def __init__(self, method: str, token: int, prob: float):
        self.method, self.token, self.prob = method, token, prob

    async def start(self) -> None:
        pass

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree]:
        return {seq.request_id: DraftTree.chain([self.token], [self.prob]) for seq, _ in wanted}

    def release(self, sequence: Sequence) -> None:
        pass


async def test_a_drafter_whose_estimates_run_high_ranks_below_one_that_keeps_its_word_once_each_is_checked():
    boastful, modest = Constant("boastful", 5, 0.9), Constant("modest", 6, 0.3)
    fused, seq = FusedSource([boastful, modest]), sequence("s")
    assert (await fused.propose([(seq, 1)]))["s"].token_ids == (5,)  # on their word, the boastful one's
    for _ in range(64):  # both verified; the modest one's token is the one accepted
        merged = (await fused.propose([(seq, 2)]))["s"]
        fused.observe(seq, [], num_verified=2, accepted_nodes=(merged.token_ids.index(6),))
    assert (await fused.propose([(seq, 1)]))["s"].token_ids == (6,)


class Fixed(Constant):
    """Always drafts the same tree."""

    def __init__(self, method: str, tree: DraftTree):
        super().__init__(method, tree.token_ids[0], tree.probs[0])
        self.tree = tree

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree]:
        return {seq.request_id: self.tree for seq, _ in wanted}


async def test_a_members_guesses_no_other_member_shares_are_trusted_as_far_as_they_alone_come_true():
    """Where drafters agree they are right far more often than where one guesses alone: a member's
    record for its lone guesses is kept apart from the one for its shared guesses."""
    guesser = Fixed("guesser", DraftTree((5, 7), (-1, -1), (0.5, 0.4)))  # 5, which the other drafts too, or 7
    fused, seq = FusedSource([guesser, Constant("other", 5, 0.5)]), sequence("s")
    for _ in range(64):  # 5 is accepted every time, so 7 never is
        merged = (await fused.propose([(seq, 2)]))["s"]
        fused.observe(seq, [], num_verified=2, accepted_nodes=(merged.token_ids.index(5),))
    merged = (await fused.propose([(seq, 2)]))["s"]
    estimates = dict(zip(merged.token_ids, merged.probs))
    assert estimates[5] > 0.8 and estimates[7] < 0.15


class OneAskAtATime(Constant):
    """Like a drafter service's stream: a second ask while one is in flight is an error."""

    def __init__(self, method: str, token: int):
        super().__init__(method, token, 0.5)
        self.in_flight, self.asks = False, 0

    async def propose(self, wanted):
        assert not self.in_flight, "asked twice at once"
        self.in_flight, self.asks = True, self.asks + 1
        await asyncio.sleep(0.01)
        self.in_flight = False
        return await super().propose(wanted)


async def ask_alone_and_fused(*sources):
    """One step's asks: a sequence drafting with the first source alone, and one drafting with `fused`."""
    drafters = Drafters(list(sources), vocab_size=64)
    await drafters.start()
    alone, together = sequence("alone"), sequence("together")
    alone.speculative = SpeculativeConfig(method=sources[0].method)
    together.speculative = SpeculativeConfig(method="fused")
    return await drafters.propose([(alone, 2), (together, 2)])


async def test_a_step_with_fused_and_member_sequences_asks_each_member_once():
    ngram, suffix = OneAskAtATime("ngram", 5), OneAskAtATime("suffix", 6)
    answers = await ask_alone_and_fused(ngram, suffix)
    assert ngram.asks == suffix.asks == 1
    assert answers.drafts["alone"].token_ids == (5,) and set(answers.drafts["together"].token_ids) == {5, 6}
    assert set(answers.round_trips) == {"ngram", "suffix", "fused"} and not answers.unanswered


async def test_fuseds_round_trip_is_its_slowest_members_and_the_merge_after_it(monkeypatch):
    """What waiting for `fused` costs the step, which `auto` weighs against the members' own round trips."""
    merge = FusedSource.fuse

    def slow_merge(self, wanted, replies):
        time.sleep(0.05)
        return merge(self, wanted, replies)
    monkeypatch.setattr(FusedSource, "fuse", slow_merge)
    answers = await ask_alone_and_fused(OneAskAtATime("ngram", 5), OneAskAtATime("suffix", 6))
    assert answers.round_trips["fused"] >= max(answers.round_trips["ngram"], answers.round_trips["suffix"]) + 0.05


class Silent(OneAskAtATime):
    """A drafter that is down: every ask goes unanswered."""

    async def propose(self, wanted):
        await super().propose(wanted)
        return None


class FromFeatures(OneAskAtATime):
    """A drafter that drafts from the target's features (as EAGLE): never one of fused's members."""
    schema = OptionSchema("eagle", wants_features=True)


async def test_a_member_that_does_not_answer_leaves_fused_the_others_drafts_and_is_named_unanswered():
    answers = await ask_alone_and_fused(Silent("ngram", 5), OneAskAtATime("suffix", 6))
    assert "alone" not in answers.drafts and answers.drafts["together"].token_ids == (6,)
    assert answers.unanswered == {"ngram"}  # fused was answered by suffix


async def test_fused_goes_unanswered_when_none_of_its_members_answer_whatever_other_drafters_do():
    answers = await ask_alone_and_fused(FromFeatures("eagle", 7), Silent("ngram", 5), Silent("suffix", 6))
    assert set(answers.drafts) == {"alone"} and answers.unanswered == {"ngram", "suffix", "fused"}
