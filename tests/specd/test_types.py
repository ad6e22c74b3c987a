"""Sampling parameters: what is greedy, and what is refused."""
import math

import pytest

from specd.client import speculative_config
from specd.errors import InvalidArgument
from specd.options import Option, OptionSchema, options_from_pb
from specd.types import SamplingParams, SpeculativeConfig, default_method
from specd.v1 import common_pb2


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 9e-6])
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    assert SamplingParams(temperature=temperature).greedy


def test_a_small_but_real_temperature_samples():
    assert not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("fields, field", [
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(temperature=math.nan), "sampling.temperature"),
    (dict(temperature=-0.5), "sampling.temperature"),
    (dict(top_p=math.nan), "sampling.top_p"),
    (dict(repetition_penalty=math.inf), "sampling.repetition_penalty"),
    (dict(repetition_penalty=math.nan), "sampling.repetition_penalty"),
])
def test_values_that_are_not_finite_or_out_of_range_name_their_field(fields, field):
    with pytest.raises(InvalidArgument) as error:
        SamplingParams(**fields).validate()
    assert error.value.field == field


def test_the_client_builds_speculative_settings_in_vllms_flat_form():
    pb = speculative_config("ngram", 4, prompt_lookup_max=3)
    assert (pb.method, pb.num_speculative_tokens, options_from_pb(pb.options)) == ("ngram", 4, {"prompt_lookup_max": 3})
    assert not speculative_config().HasField("num_speculative_tokens")  # left to the deployment


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, [1, 2], {"nested": 1}])
@pytest.mark.parametrize("known", [True, False], ids=["declared-options", "options-not-known-yet"])
def test_an_option_that_is_no_finite_number_bool_or_string_is_refused_naming_it(value, known):
    """Found by tests/fuzz: a NaN or an infinity once failed the request as INTERNAL (turning it into JSON)."""
    schema = OptionSchema("ngram", (Option("prompt_lookup_min", "int", 2, minimum=1),), known=known)
    request = common_pb2.SpeculativeConfig(method="ngram")
    request.options.update({"prompt_lookup_min": value})
    with pytest.raises(InvalidArgument) as error:
        SpeculativeConfig().resolve(request, {"ngram": schema})
    assert error.value.field == "speculative.options.prompt_lookup_min"


@pytest.mark.parametrize("served, method", [
    (["none", "ngram", "suffix", "auto"], "auto"),
    (["none", "eagle"], "eagle"),  # auto leaves out drafters of the target's features
    (["none"], "none"),
])
def test_a_deployment_not_told_its_method_serves_auto_else_its_one_drafter_else_none(served, method):
    schemas = {m: OptionSchema(m) for m in served}
    assert default_method(served) == method
    assert SpeculativeConfig().resolve(common_pb2.SpeculativeConfig(), schemas).method == method
    assert SpeculativeConfig(method="none").resolve(common_pb2.SpeculativeConfig(), schemas).method == "none"
