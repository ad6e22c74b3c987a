import pytest

from drafter_svc.proposers.ngram import NgramProposer
from gateway.validation import check_prompt_fits, validate_request
from specd.errors import InvalidArgument
from specd.limits import MAX_CORPUS_SCOPE_CHARS
from specd.options import options_to_pb
from specd.types import MAX_SPECULATIVE_TOKENS, NONE_SCHEMA, SpeculativeConfig
from specd.v1 import common_pb2, generation_pb2

DEFAULT_SPECULATIVE = SpeculativeConfig(method="ngram", num_speculative_tokens=4, options={"prompt_lookup_max": 4})
SERVED = {"none": NONE_SCHEMA, "ngram": NgramProposer.schema}  # as the target's ModelInfo describes them
MAX_PROMPT_CHARS = 1000


def validate(**fields) -> None:
    return validate_request(generation_pb2.GenerateRequest(**fields), DEFAULT_SPECULATIVE, SERVED, MAX_PROMPT_CHARS)


def field_of_error(**fields) -> str:
    with pytest.raises(InvalidArgument) as error:
        validate(**fields)
    return error.value.field


def chat(*roles: str) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role=r, content="hi") for r in roles])


def test_a_request_without_input_or_with_an_empty_prompt_names_prompt():
    assert field_of_error() == "prompt"
    assert field_of_error(prompt="") == "prompt"


def test_chat_without_messages_names_chat_messages():
    assert field_of_error(chat=generation_pb2.ChatMessages()) == "chat.messages"


def test_an_unknown_role_names_the_message():
    assert field_of_error(chat=chat("system", "user", "robot")) == "chat.messages[2].role"


def test_every_chat_role_is_accepted():
    validate(chat=chat("system", "user", "assistant", "user"))


def test_sampling_values_are_checked():
    assert field_of_error(prompt="x", sampling=common_pb2.SamplingParams(temperature=-1)) == "sampling.temperature"
    assert field_of_error(prompt="x", sampling=common_pb2.SamplingParams(top_p=1.5)) == "sampling.top_p"


def test_a_method_the_target_does_not_serve_is_refused():
    assert field_of_error(prompt="x", speculative=common_pb2.SpeculativeConfig(method="eagle")) == "speculative.method"


def test_the_speculative_config_is_the_default_with_the_request_fields_on_top():
    options = validate(prompt="x", speculative=common_pb2.SpeculativeConfig(
        num_speculative_tokens=2, options=options_to_pb({"prompt_lookup_min": 3})))
    assert options.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                                    options={"prompt_lookup_min": 3, "prompt_lookup_max": 4})


def test_options_are_checked_by_the_methods_own_declaration():
    def config(**options):
        return common_pb2.SpeculativeConfig(options=options_to_pb(options))
    assert field_of_error(prompt="x", speculative=config(prompt_lookup_min=0)) == "speculative.options.prompt_lookup_min"
    assert field_of_error(prompt="x", speculative=config(prompt_lookup_min=2.5)) == \
        "speculative.options.prompt_lookup_min"
    assert field_of_error(prompt="x", speculative=config(prompt_lookup_min=5)) == "speculative.options.prompt_lookup_max"
    assert field_of_error(prompt="x", speculative=config(draft_model="x")) == "speculative.options.draft_model"


def test_the_defaults_options_of_another_method_do_not_leak_into_a_request():
    options = validate(prompt="x", speculative=common_pb2.SpeculativeConfig(method="none"))
    assert options.speculative == SpeculativeConfig(method="none", num_speculative_tokens=4, options={})


def test_a_merged_speculative_config_out_of_range_is_refused():
    too_many = common_pb2.SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1)
    assert field_of_error(prompt="x", speculative=too_many) == "speculative.num_speculative_tokens"


def test_a_corpus_scope_is_kept_and_bounded():
    scoped = validate(prompt="x", speculative=common_pb2.SpeculativeConfig(corpus_scope="tenant-7"))
    assert scoped.speculative.corpus_scope == "tenant-7" and scoped.speculative.to_pb().corpus_scope == "tenant-7"
    too_long = common_pb2.SpeculativeConfig(corpus_scope="x" * (MAX_CORPUS_SCOPE_CHARS + 1))
    assert field_of_error(prompt="x", speculative=too_long) == "speculative.corpus_scope"


def test_at_most_sixteen_stop_strings():
    assert validate(prompt="x", stop=[str(i) for i in range(16)]).stop == tuple(str(i) for i in range(16))
    assert field_of_error(prompt="x", stop=[str(i) for i in range(17)]) == "stop"


def test_an_empty_stop_string_names_its_index():
    assert field_of_error(prompt="x", stop=["a", ""]) == "stop[1]"


def test_a_prompt_filling_the_context_is_refused_with_both_lengths():
    with pytest.raises(InvalidArgument) as error:
        check_prompt_fits("prompt", 2048, max_context_length=2048)
    assert error.value.field == "prompt"
    assert "2048 tokens, the context holds 2048" in str(error.value)


def test_a_prompt_leaving_one_token_of_context_fits():
    check_prompt_fits("prompt", 2047, max_context_length=2048)


def test_max_tokens_reaching_past_the_context_is_no_error():
    # The target clips it and finishes with LENGTH at the context's end.
    validate(prompt="x", sampling=common_pb2.SamplingParams(max_tokens=10**6))


def test_input_longer_than_any_tokenization_could_fit_names_its_field():
    assert field_of_error(prompt="x" * (MAX_PROMPT_CHARS + 1)) == "prompt"
    long_chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="x" * 600)] * 2)
    assert field_of_error(chat=long_chat) == "chat.messages"
    validate(prompt="x" * MAX_PROMPT_CHARS)
