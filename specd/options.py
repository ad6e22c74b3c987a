"""Per-method speculative options, declared once next to each method's code as data.

A method (a drafter, or a proposer inside the target) declares its options as an `OptionSchema`;
the schema travels through the APIs as a `MethodInfo` message, so every service that receives a
request validates its options by the method's own declaration without knowing the method.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict

from specd.errors import InvalidArgument
from specd.limits import MAX_OPTION_CHARS, MAX_OPTIONS
from specd.v1 import common_pb2

OptionValue = int | float | bool | str
_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "string": str}


@dataclass(frozen=True)
class Option:
    name: str
    type: str  # int | float | bool | string
    default: OptionValue
    minimum: float | None = None
    maximum: float | None = None
    at_least: str = ""  # another option this one must not be below
    help: str = ""

    def check(self, value: Any, field_name: str) -> OptionValue:
        """`value` as this option's type, or InvalidArgument naming the field."""
        value = _as_type(self.type, value, field_name)
        if self.minimum is not None and value < self.minimum:
            raise InvalidArgument(field_name, f"must be >= {self.minimum:g}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise InvalidArgument(field_name, f"must be <= {self.maximum:g}, got {value}")
        return value

    def to_pb(self) -> common_pb2.OptionSpec:
        pb = common_pb2.OptionSpec(name=self.name, type=self.type, at_least=self.at_least, help=self.help)
        pb.default_value.MergeFrom(struct_pb2.Value(**_value_kwargs(self.default)))
        if self.minimum is not None:
            pb.minimum = self.minimum
        if self.maximum is not None:
            pb.maximum = self.maximum
        return pb

    @classmethod
    def from_pb(cls, pb: common_pb2.OptionSpec) -> Option:
        default = _as_type(pb.type, MessageToDict(pb.default_value), f"{pb.name}.default")
        return cls(pb.name, pb.type, default, pb.minimum if pb.HasField("minimum") else None,
                   pb.maximum if pb.HasField("maximum") else None, pb.at_least, pb.help)


@dataclass(frozen=True)
class OptionSchema:
    """The options one method takes. `known` is False while they are not known yet (the method's
    drafter has not described itself): then given options pass on unchecked but for their type."""
    method: str
    options: tuple[Option, ...] = field(default=())
    known: bool = True
    wants_features: bool = False  # the method drafts from the target's features (EAGLE)
    learns_outputs: bool = False  # its drafter learns from whole outputs of finished sequences
    # With wants_features: the target layers whose input it drafts from, concatenated (EAGLE-3); () the last
    # layer's output after the final norm (EAGLE).
    feature_layers: tuple[int, ...] = ()

    def resolve(self, given: Mapping[str, Any], field_prefix: str = "speculative.options") -> dict[str, OptionValue]:
        """Every option of the method: the given ones checked, the rest at their defaults."""
        if not self.known:
            return {name: _as_plain_value(value, f"{field_prefix}.{name}") for name, value in given.items()}
        by_name = {option.name: option for option in self.options}
        for name in given:
            if name not in by_name:
                known = ", ".join(by_name) or "none"
                raise InvalidArgument(f"{field_prefix}.{name}",
                                      f"not an option of method {self.method!r} (its options: {known})")
        values = {o.name: o.check(given[o.name], f"{field_prefix}.{o.name}") if o.name in given else o.default
                  for o in self.options}
        for option in self.options:
            if option.at_least and values[option.name] < values[option.at_least]:
                raise InvalidArgument(f"{field_prefix}.{option.name}",
                                      f"must be >= {option.at_least} ({values[option.at_least]}), "
                                      f"got {values[option.name]}")
        return values

    def to_pb(self) -> common_pb2.MethodInfo:
        return common_pb2.MethodInfo(method=self.method, options=[o.to_pb() for o in self.options],
                                     options_unknown=not self.known, wants_features=self.wants_features,
                                     learns_outputs=self.learns_outputs, feature_layers=self.feature_layers)

    @classmethod
    def from_pb(cls, pb: common_pb2.MethodInfo) -> OptionSchema:
        return cls(pb.method, tuple(Option.from_pb(o) for o in pb.options), known=not pb.options_unknown,
                   wants_features=pb.wants_features, learns_outputs=pb.learns_outputs,
                   feature_layers=tuple(pb.feature_layers))


def options_from_pb(pb: struct_pb2.Struct, field_prefix: str = "speculative.options") -> dict[str, Any]:
    """A Struct of options as a dict, its size bounded (values are checked by the method's schema)."""
    if len(pb.fields) > MAX_OPTIONS:
        raise InvalidArgument(field_prefix, f"at most {MAX_OPTIONS} options, got {len(pb.fields)}")
    for name in pb.fields:
        if len(name) > MAX_OPTION_CHARS:
            raise InvalidArgument(field_prefix, f"option names have at most {MAX_OPTION_CHARS} characters")
    return {name: _plain_value_of(value, f"{field_prefix}.{name}") for name, value in pb.fields.items()}


def _plain_value_of(value: struct_pb2.Value, field_name: str) -> Any:
    """An option's value as it came: None, a number (a float, as in JSON; NaN and infinities too, for the
    schema to refuse by name), a bool or a string. No option takes a list or a struct."""
    kind = value.WhichOneof("kind")
    if kind in ("list_value", "struct_value"):
        raise InvalidArgument(field_name, f"must be a number, a bool or a string, not a {kind.removesuffix('_value')}")
    return None if kind in (None, "null_value") else getattr(value, kind)


def options_to_pb(options: Mapping[str, OptionValue]) -> struct_pb2.Struct:
    pb = struct_pb2.Struct()
    pb.update(dict(options))
    return pb


def _as_type(type_name: str, value: Any, field_name: str) -> OptionValue:
    """Struct numbers arrive as floats: an int option takes only whole ones."""
    wanted = _TYPES.get(type_name)
    if wanted is None:
        raise InvalidArgument(field_name, f"unknown option type {type_name!r}")
    if wanted is bool or wanted is str:
        if not isinstance(value, wanted):
            raise InvalidArgument(field_name, f"must be a {type_name}, got {value!r}")
        if wanted is str and len(value) > MAX_OPTION_CHARS:
            raise InvalidArgument(field_name, f"at most {MAX_OPTION_CHARS} characters")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(field_name, f"must be a finite number, got {value!r}")
    if wanted is int:
        if value != int(value):
            raise InvalidArgument(field_name, f"must be a whole number, got {value}")
        return int(value)
    return float(value)


def _as_plain_value(value: Any, field_name: str) -> OptionValue:
    if isinstance(value, bool | str) or isinstance(value, (int, float)) and math.isfinite(value):
        return value
    raise InvalidArgument(field_name, f"must be a number, a bool or a string, got {value!r}")


def _value_kwargs(value: OptionValue) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"bool_value": value}
    if isinstance(value, str):
        return {"string_value": value}
    return {"number_value": float(value)}
