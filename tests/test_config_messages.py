"""What a config error says: an unknown key gets the closest known one at its level (a typo at any
depth, as policy parameters do), and a value set by a ``MERGESTREAM_…`` environment variable names
that variable, never its value (it may be a secret), instead of pointing at the file alone."""

from __future__ import annotations

import os
from typing import Any

import pytest
from pydantic import BaseModel

from mergestream.config import Config, ConfigError, load_config
from mergestream.settings_base import model_at

HEAD = "base: base.safetensors\n"


@pytest.fixture(autouse=True)
def no_mergestream_environment(monkeypatch):
    for k in list(os.environ):
        if k.upper().startswith("MERGESTREAM_"):
            monkeypatch.delenv(k)


def refused(tmp_path, body: str) -> str:
    p = tmp_path / "config.yaml"
    p.write_text(HEAD + body)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    return str(info.value)


def _section_fields(model: type[BaseModel], at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field reachable from ``model`` through sections that are one model (not lists)."""
    out = []
    for name, field in model.model_fields.items():
        out.append((*at, field.alias or name))
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is not None:
            out += _section_fields(sub, (*at, field.alias or name))
    return out


def _nest(path: tuple[str, ...], value: Any) -> str:
    lines = []
    for depth, key in enumerate(path[:-1]):
        lines.append("  " * depth + f"{key}:")
    lines.append("  " * (len(path) - 1) + f"{path[-1]}: {value}")
    return "\n".join(lines) + "\n"


FIELDS = [f for f in _section_fields(Config) if f != ("base",)]


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
def test_a_typo_of_any_key_names_the_key_meant(path, tmp_path):
    typo = (*path[:-1], path[-1] + "x")
    msg = refused(tmp_path, _nest(typo, 1))
    assert f"{'.'.join(typo)}: unknown key (did you mean {path[-1]!r}?)" in msg, msg
    assert "Extra inputs" not in msg


def test_a_key_nothing_resembles_lists_the_keys_of_its_level(tmp_path):
    msg = refused(tmp_path, "gate:\n  rules:\n    - metric: g\n      zzz: 1\n")
    assert "gate.rules.0.zzz: unknown key (known here: metric, " in msg, msg


def test_model_at_looks_through_lists_and_optionals():
    from mergestream.config import GateConfig, WatchConfig

    assert model_at(Config, ("watch", "x")) is WatchConfig
    assert model_at(Config, ("gate", "x")) is GateConfig
    assert model_at(Config, ("gate", "rules", 0, "x")).__name__ == "GateRule"
    assert model_at(Config, ("nope", "x")) is None


@pytest.mark.parametrize("variable, value, where", [
    ("MERGESTREAM_RETENTION", "true", "retention"),
    ("MERGESTREAM_METRICS__PORT", "s3cr3t-token-value", "metrics.port"),
    ("MERGESTREAM_WATCH__SETTLE_SECONDS", "hunter2", "watch.settle_seconds"),
])
def test_a_bad_value_from_the_environment_names_its_variable_not_its_value(variable, value, where, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv(variable, value)
    msg = refused(tmp_path, "")
    assert f"{where}: " in msg and f"(from the environment variable {variable})" in msg, msg
    assert value not in msg


def test_a_bad_value_in_the_file_does_not_blame_the_environment(tmp_path):
    msg = refused(tmp_path, "retention: many\n")
    assert "retention: " in msg and "environment" not in msg, msg


def test_a_section_set_as_json_is_named_only_for_the_keys_it_holds(tmp_path, monkeypatch):
    """``MERGESTREAM_WATCH`` (a JSON object) is merged with the file's ``watch:`` keys: an error in a
    key it holds names it; an error in a key only the file gives does not."""
    monkeypatch.setenv("MERGESTREAM_WATCH", '{"settle_seconds": "soon"}')
    msg = refused(tmp_path, "watch:\n  poll_interval: often\n")
    assert "watch.settle_seconds: " in msg and "(from the environment variable MERGESTREAM_WATCH)" in msg, msg
    poll = next(part for part in msg.split("; ") if "watch.poll_interval" in part)
    assert "environment" not in poll, msg
