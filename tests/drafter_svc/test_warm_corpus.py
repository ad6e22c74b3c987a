"""The warm corpus: what the suffix and trie drafters start from, shipped for the default model."""
import pytest

from drafter_svc import warm_corpus
from specd.model_store import DEFAULT_MODEL


def test_a_corpus_keeps_its_outputs_in_order_and_the_model_they_came_from(tmp_path):
    outputs = [[1, 2, 3], [], [49151, 0], [7] * 300]
    path = tmp_path / "corpus.npz"
    warm_corpus.save(path, outputs, "some-model")
    assert warm_corpus.load(path) == outputs and warm_corpus.model_of(path) == "some-model"


def test_by_default_a_drafter_starts_from_the_corpus_shipped_for_its_model():
    shipped = warm_corpus.resolve(None, DEFAULT_MODEL)
    assert shipped is not None and warm_corpus.model_of(shipped) == DEFAULT_MODEL
    outputs = warm_corpus.load(shipped)
    assert len(outputs) > 500 and all(0 <= token < 49152 for output in outputs for token in output)
    assert warm_corpus.resolve(None, "a-model-without-one") is None


def test_none_starts_empty_and_a_file_is_taken_as_given(tmp_path):
    assert warm_corpus.resolve("none", DEFAULT_MODEL) is None
    path = tmp_path / "mine.npz"
    warm_corpus.save(path, [[1, 2]], DEFAULT_MODEL)
    assert warm_corpus.resolve(str(path), DEFAULT_MODEL) == path
    with pytest.raises(FileNotFoundError, match="specd train corpus"):
        warm_corpus.resolve(str(tmp_path / "missing.npz"), DEFAULT_MODEL)
