"""Reading a job spec file (YAML or JSON): what `trident` and the torchrun entry point load.

YAML numbers are read as YAML 1.2 reads them: PyYAML (YAML 1.1) takes `3e-4`, a float
without a dot, for a string, which the spec, strict about numbers, would refuse.
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml


class SpecLoader(yaml.SafeLoader):
    """A SafeLoader that also resolves exponent floats without a dot (`3e-4`, `1E5`)."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"))


def load_yaml(text: str | IO[str]) -> Any:
    """The document in `text`, read safely with `SpecLoader`."""
    return yaml.load(text, Loader=SpecLoader)  # a SafeLoader subclass


def set_field(raw: dict[str, Any], field: str, value: Any) -> None:
    """Set dotted `field` (`train.steps`) of a spec's raw mapping to `value`, making the
    mappings on the way (a field that held something else, such as `parallel: auto`,
    becomes a mapping): what `trident submit --set` and a resubmission's `set` do."""
    node = raw
    *parents, last = field.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value
