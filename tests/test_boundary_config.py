"""A key repeated in one YAML mapping is refused at load, naming the dotted key and both lines (issue
#36, T3-04): PyYAML alone keeps the later block silently (a left-over ``gate:`` switched the rule
off). Every depth: top-level sections, keys inside a section, inside a list item. YAML merge keys
(``<<: *anchor``) with an explicit override are not repeats and still load."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from mergestream.config import ConfigError, load_config

from .conftest import run_cli

HEAD = "base: base.safetensors\ninbox: inbox\nstate_dir: state\n"


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(HEAD + textwrap.dedent(body))
    return p


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


REPEATS = {
    "policy": ("""\
        policy:
          name: ties
          params: {k: 20}
        retention: 3
        policy:
          name: task_arithmetic
        """, "policy", 4, 8),
    "gate": ("""\
        gate:
          rules: [{metric: step_drift, direction: lower, max_value: 1.0}]
        gate:
          rules: []
        """, "gate", 4, 6),
    "retention": ("retention: 3\nmetrics: {port: 0}\nretention: 9\n", "retention", 4, 6),
    "nested gate.rules": ("""\
        gate:
          rules: [{metric: step_drift, max_value: 1.0}]
          rules: []
        """, "gate.rules", 5, 6),
    "nested policy.params.lambda": ("""\
        policy:
          name: task_arithmetic
          params:
            lambda: 0.3
            lambda: 1.0
        """, "policy.params.lambda", 7, 8),
    "inside a list item": ("""\
        gate:
          rules:
            - metric: step_drift
              direction: lower
              max_value: 1.0
            - metric: relative_drift
              max_value: 0.5
              max_value: 50
        """, "gate.rules[1].max_value", 10, 11),
    "inside a probe item": ("""\
        probes:
          - type: weight_space
          - type: entrypoint
            params: {target: "a.b:c", target: "x.y:z"}
        """, "probes[1].params.target", 7, 7),
    "flow mapping": ("mlflow: {enabled: false, enabled: true}\n", "mlflow.enabled", 4, 4),
}


@pytest.mark.parametrize("case", sorted(REPEATS))
def test_a_repeated_key_is_refused_naming_the_dotted_key_and_both_lines(tmp_path, case):
    body, key, first, second = REPEATS[case]
    msg = refused(write(tmp_path, body))
    assert f"key {key} given twice (line {first} and line {second})" in msg, msg


def test_every_repeat_is_named_at_once(tmp_path):
    msg = refused(write(tmp_path, """\
        policy: {name: ties}
        gate: {rules: []}
        retention: 2
        policy: {name: task_arithmetic}
        gate: {rules: []}
        retention: 5
        """))
    assert re.findall(r"key (\w+) given twice", msg) == ["policy", "gate", "retention"], msg


def test_equal_keys_in_different_mappings_are_not_repeats(tmp_path):
    cfg = load_config(write(tmp_path, """\
        gate:
          rules:
            - {metric: step_drift, direction: lower, max_value: 1.0}
            - {metric: step_drift, direction: lower, max_ratio_to_history: 5.0}
        metrics: {port: 0}
        """))
    assert [r.metric for r in cfg.gate.rules] == ["step_drift", "step_drift"]


def test_merge_keys_with_an_explicit_override_still_load(tmp_path):
    cfg = load_config(write(tmp_path, """\
        gate:
          rules:
            - &drift {metric: relative_drift, direction: lower, max_value: 0.5}
            - <<: *drift
              max_value: 0.25
            - &steps {metric: step_drift, direction: lower, max_ratio_to_history: 10.0}
            - <<: [*steps, *drift]
              metric: step_drift
              required: true
        """))
    got = [(r.metric, r.max_value, r.max_ratio_to_history, r.required) for r in cfg.gate.rules]
    assert got == [("relative_drift", 0.5, None, False), ("relative_drift", 0.25, None, False),
                   ("step_drift", None, 10.0, False), ("step_drift", 0.5, 10.0, True)]


def test_a_key_repeated_beside_a_merge_key_is_still_a_repeat(tmp_path):
    msg = refused(write(tmp_path, """\
        gate:
          rules:
            - &drift {metric: relative_drift, max_value: 0.5}
            - <<: *drift
              max_value: 0.25
              max_value: 0.1
        """))
    assert "key gate.rules[1].max_value given twice (line 8 and line 9)" in msg, msg


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path):
    body, key, first, second = REPEATS["nested gate.rules"]
    proc = run_cli("status", "--config", write(tmp_path, body), check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"key {key} given twice (line {first} and line {second})" in lines[0]
