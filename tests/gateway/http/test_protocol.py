"""OpenAI request bodies become the same GenerateRequest a gRPC client would send."""
import pytest

from gateway.http.protocol import ChatCompletionRequest, CompletionRequest
from specd.errors import InvalidArgument
from specd.options import options_from_pb


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **fields)


def test_unset_sampling_fields_take_openai_defaults():
    sampling = chat().to_request().sampling
    assert sampling.temperature == 1.0 and sampling.top_p == 1.0 and sampling.max_tokens == 0
    assert not sampling.HasField("seed")
    assert CompletionRequest(model="m", prompt="Hi").to_request().sampling.max_tokens == 16


def test_max_completion_tokens_wins_over_the_older_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).to_request().sampling.max_tokens == 9


def test_vllm_extensions_map_onto_specd_sampling():
    sampling = chat(top_k=-1, repetition_penalty=1.2, seed=3).to_request().sampling
    assert sampling.top_k == 0 and sampling.repetition_penalty == pytest.approx(1.2) and sampling.seed == 3


def test_a_single_stop_string_is_a_list_of_one():
    assert list(chat(stop="\n").to_request().stop) == ["\n"]


def test_speculative_config_flat_keys_become_method_budget_and_options():
    speculative = chat(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_max": 3}).to_request().speculative
    assert speculative.method == "ngram" and speculative.num_speculative_tokens == 4
    assert options_from_pb(speculative.options) == {"prompt_lookup_max": 3}
    assert chat(speculative_config={"corpus_scope": "tenant-7"}).to_request().speculative.corpus_scope == "tenant-7"


def test_text_parts_join_and_the_developer_role_is_system():
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi"}]).to_request()
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_an_image_part_is_refused_naming_its_place():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidArgument) as error:
        body.to_request()
    assert error.value.field == "messages[0].content[0].type"


@pytest.mark.parametrize("fields, field", [({"n": 3}, "n"), ({"frequency_penalty": 1.0}, "frequency_penalty"),
                                           ({"logit_bias": {"1": 5.0}}, "logit_bias"), ({"seed": -1}, "seed"),
                                           ({"speculative_config": {"num_speculative_tokens": "4"}},
                                            "speculative_config.num_speculative_tokens"),
                                           ({"speculative_config": {"corpus_scope": 7}}, "speculative_config.corpus_scope")])
def test_unsupported_or_malformed_fields_are_refused_by_name(fields, field):
    with pytest.raises(InvalidArgument) as error:
        chat(**fields).to_request()
    assert error.value.field == field


def test_a_completion_takes_one_prompt():
    assert CompletionRequest(model="m", prompt=["Once"]).to_request().prompt == "Once"
    with pytest.raises(InvalidArgument):
        CompletionRequest(model="m", prompt=["a", "b"]).to_request()


def test_logprobs_ask_the_target_for_the_requested_top_count():
    assert not chat().to_request().sampling.HasField("logprobs")
    assert chat(logprobs=True).to_request().sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).to_request().sampling.logprobs == 5
    assert CompletionRequest(model="m", prompt="Hi", logprobs=3).to_request().sampling.logprobs == 3
    with pytest.raises(InvalidArgument):
        chat(top_logprobs=2).to_request()  # without logprobs: true
