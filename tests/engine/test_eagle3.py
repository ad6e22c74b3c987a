"""The EAGLE-3 head on its paged KV cache computes what EAGLE-3 defines (tests/eagle3_reference.py): from the
target's three layers [3D] for committed pairs, and from its own estimates [D] for the pairs it drafts."""
import torch

from engine.eagle import EagleRunner
from engine.runner import SequenceInput
from tests.eagle3_reference import write_published_eagle3_head


def test_the_paged_eagle3_head_computes_what_eagle3_defines_on_target_and_own_features(tiny_model_dir, tmp_path):
    reference = write_published_eagle3_head(tiny_model_dir, tmp_path, layers=[1, 0, 1])
    runner = EagleRunner(tmp_path, tiny_model_dir, kv_cache_tokens=64, block_size=4)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 49152, (9,), generator=g).tolist()
    target_features = torch.randn(6, 3 * 64, generator=g)
    # Six committed pairs on the target's features at once, then three drafted pairs, each on the head's
    # estimate from the pair before it, one by one on the cache.
    logits, out = runner.draft([SequenceInput("s", ids[:6], 0, num_logits=6)], target_features)
    hidden, outs, rows = reference.hidden(target_features), [out], [logits]
    for p in range(6, 9):
        logits, out = runner.draft([SequenceInput("s", ids[p:p + 1], p, num_logits=1)], outs[-1][-1:])
        outs.append(out)
        rows.append(logits)
    with torch.no_grad():
        expected = reference(ids[:6], hidden)
        for p in range(6, 9):
            hidden = torch.cat([hidden, expected[-1:]])
            expected = reference(ids[:p + 1], hidden)
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(rows), reference.logits(expected), atol=1e-4, rtol=1e-4)
    assert torch.equal(runner.model.draft_vocab, reference.draft_vocab)
