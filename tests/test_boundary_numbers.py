"""A boolean given for a number setting is refused, naming the setting. Pydantic's lax mode read
``true`` as 1 and ``false`` as 0: ``k: true`` kept TIES's top 1 %, ``patch_format: true`` picked
format 1 and ``anchor_examples: true`` kept one anchor, all without a word. The whole kind: every
number field of every settings model (config sections, the config root, every policy's and
wrapper's parameters), through the model, the YAML file and a policy built by name."""

from __future__ import annotations

import importlib
import pkgutil
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

import mergestream
from mergestream.config import ConfigError, load_config
from mergestream.settings_base import NumbersNotBooleans, is_number
from mergestream.errors import PolicyError
from mergestream.policies import REGISTRY, make_policy


def _settings_models() -> list[type[NumbersNotBooleans]]:
    for mod in pkgutil.walk_packages(mergestream.__path__, "mergestream."):
        try:
            importlib.import_module(mod.name)
        except ImportError:  # an optional extra (ray, boto3) this machine lacks
            pass
    out, todo = [], [NumbersNotBooleans]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return sorted(set(out), key=lambda c: c.__module__ + c.__qualname__)


NUMBER_FIELDS = [(cls, f.alias or name) for cls in _settings_models()
                 for name, f in cls.model_fields.items() if is_number(f.annotation)]


def test_the_walk_finds_the_models_it_must_cover():
    names = {cls.__name__ for cls, _ in NUMBER_FIELDS}
    assert {"Config", "RIConfig", "DistillConfig", "GateRule", "BudgetParams", "LinesParams"} <= names
    assert len(NUMBER_FIELDS) > 60


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("cls,key", NUMBER_FIELDS, ids=[f"{c.__name__}.{k}" for c, k in NUMBER_FIELDS])
def test_a_boolean_for_a_number_field_is_refused_at_that_field(cls, key, value):
    with pytest.raises(ValidationError) as info:
        cls.model_validate({key: value})
    at_field = [e for e in info.value.errors() if e["loc"] == (key,)]
    assert at_field and "expects a number, not a boolean" in at_field[0]["msg"], info.value.errors()


def test_numbers_and_real_booleans_still_load(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(textwrap.dedent("""\
        base: base.safetensors
        retention: 3
        patch_format: 2
        write_patches: false
        policy:
          name: ties
          params: {k: 20, lambda: 1}
        """))
    cfg = load_config(p)
    assert (cfg.retention, cfg.patch_format, cfg.write_patches) == (3, 2, False)
    assert cfg.policy.params == {"k": 20, "lambda": 1}


@pytest.mark.parametrize("body,where", [
    ("patch_format: true\n", "patch_format"),
    ("retention: false\n", "retention"),
    ("policy:\n  name: ties\n  params: {k: true}\n", "k"),
    ("policy:\n  name: iso_c\n  params: {patch_budget: true}\n", "patch_budget"),
    ("policy:\n  postprocess: [distill]\n  distill: {anchor_examples: true}\n", "anchor_examples"),
    ("gate:\n  rules: [{metric: step_drift, max_value: true}]\n", "max_value"),
])
def test_the_config_file_refuses_a_boolean_number_naming_it(tmp_path, body, where):
    p = tmp_path / "config.yaml"
    p.write_text("base: base.safetensors\n" + body)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    msg = str(info.value)
    assert where in msg and "not a boolean" in msg, msg


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_built_by_name_refuses_a_boolean_number(name):
    cls = REGISTRY[name].Params
    keys = [f.alias or k for k, f in cls.model_fields.items() if is_number(f.annotation)]
    for key in keys + ["patch_budget", "lines_alpha"]:
        with pytest.raises(PolicyError, match=rf"{key}.*not a boolean"):
            make_policy(name, {key: True})
