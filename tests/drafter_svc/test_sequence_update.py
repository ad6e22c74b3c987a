"""A sequence update's token ids are checked against the target's vocabulary before the drafter keeps them."""
import pytest

from drafter_svc.sequences import SequenceUpdate
from specd.errors import InvalidArgument
from specd.v1 import drafter_pb2

VOCAB_SIZE = 49152


def update_pb(token_ids) -> drafter_pb2.SequenceUpdate:
    return drafter_pb2.SequenceUpdate(sequence_id="s", appended_token_ids=token_ids)


def test_token_ids_from_zero_to_the_last_of_the_vocabulary_are_taken():
    update = SequenceUpdate.from_pb(update_pb([0, 7, VOCAB_SIZE - 1]), "sequences[0]", VOCAB_SIZE)
    assert update.appended_token_ids == [0, 7, VOCAB_SIZE - 1]


@pytest.mark.parametrize("token_ids, index, token_id", [
    ([5, VOCAB_SIZE, 6], 1, VOCAB_SIZE),
    ([-1], 0, -1),
    ([1, 2, 3, 2**31 - 1, -7], 3, 2**31 - 1),  # the first one outside is named
])
def test_the_first_token_id_outside_the_vocabulary_is_refused_by_its_index(token_ids, index, token_id):
    with pytest.raises(InvalidArgument) as error:
        SequenceUpdate.from_pb(update_pb(token_ids), "sequences[3]", VOCAB_SIZE)
    assert str(error.value) == (f"sequences[3].appended_token_ids[{index}]: token id {token_id} is outside the "
                                f"vocabulary (0..{VOCAB_SIZE - 1})")
