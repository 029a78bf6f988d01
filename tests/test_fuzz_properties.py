"""Every parser of outside bytes ends in a value or in one of the project's own exceptions.

The same targets as the coverage-guided fuzzer (``bench/fuzz_targets.py``, run by ``bench/fuzz.py``),
here as hypothesis properties with a bounded number of examples so CI stays fast: random bytes,
mutated valid inputs (bytes flipped, cut, spliced) and, for the JSON and YAML targets, generated
documents of any shape (nesting, types, sizes a valid input never has). Every crash the fuzzer has
found (``tests/fuzz_regressions/<target>/``) is replayed as its own case.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parent.parent / "bench"
REGRESSIONS = Path(__file__).resolve().parent / "fuzz_regressions"

_spec = importlib.util.spec_from_file_location("fuzz_targets", BENCH / "fuzz_targets.py")
fuzz_targets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_targets)

SEEDS = fuzz_targets.seeds()
JSON_TARGETS = ("shard_index", "adapter_config", "webhook", "s3_notify", "feed_custom")
PROPERTY = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
#: JSON documents of any shape, with the field names the parsers look for among the keys
_keys = st.one_of(st.text(max_size=8), st.sampled_from(sorted({
    "weight_map", "metadata", "total_size", "peft_type", "r", "lora_alpha", "target_modules", "fan_in_fan_out",
    "use_rslora", "alpha_pattern", "rank_pattern", "init_lora_weights", "modules_to_save", "entity", "action",
    "data", "name", "version", "EventName", "Records", "eventName", "latest", "targets", "installed", "custom",
    "mergestream", "kind", "weights_sha256", "from_sha256", "to_sha256", "from_version", "to_version", "file",
    "release", "rollback", "length"})))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=5),
                     max_leaves=25)


def _mutations(seeds: list[bytes]):
    """A valid seed with a few bytes replaced, a cut, or two seeds spliced."""
    def mutate(draw_seed: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
        b = bytearray(draw_seed)
        for pos, val in edits:
            if b:
                b[pos % len(b)] = val
        return bytes(b[:cut] if cut is not None else b)

    return st.builds(mutate, st.sampled_from(seeds),
                     st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6),
                     st.one_of(st.none(), st.integers(0, 4096)))


def _inputs(name: str):
    strategies = [st.binary(max_size=512), _mutations(SEEDS[name])]
    if name in JSON_TARGETS:
        strategies.append(_json.map(lambda doc: json.dumps(doc).encode()))
        # a valid document with one field replaced by anything
        valid = json.loads(SEEDS[name][0])
        strategies.append(st.builds(lambda k, v: json.dumps({**valid, k: v}).encode(),
                                    st.sampled_from(sorted(valid)), _json))
    if name == "config_yaml":
        import yaml

        strategies.append(st.dictionaries(_keys | st.sampled_from(["policy", "gate", "retention", "mlflow", "s3",
                                                                   "metrics", "feed", "probes", "publish"]),
                                          _json, max_size=4)
                          .map(lambda d: ("base: base.safetensors\n" + yaml.safe_dump(d)).encode()))
    return st.one_of(strategies)


@pytest.fixture(scope="module")
def targets():
    made = {name: fuzz_targets.make(name) for name in fuzz_targets.TARGET_NAMES}
    yield made
    for t in made.values():
        t.close()


@pytest.mark.parametrize("name", fuzz_targets.TARGET_NAMES)
def test_the_valid_seeds_are_accepted(targets, name):
    for data in SEEDS[name]:
        targets[name].run(data)  # no exception at all: the seeds are what a good input looks like


_REGRESSION_FILES = sorted(p for p in REGRESSIONS.glob("*/*") if p.is_file())


@pytest.mark.parametrize("path", _REGRESSION_FILES, ids=[f"{p.parent.name}/{p.name[:12]}" for p in _REGRESSION_FILES])
def test_every_input_the_fuzzer_crashed_on_is_handled_now(targets, path):
    fuzz_targets.check(targets[path.parent.name], path.read_bytes())


@pytest.mark.parametrize("name", fuzz_targets.TARGET_NAMES)
def test_any_input_ends_in_a_value_or_a_project_error(targets, name):
    @PROPERTY
    @given(data=_inputs(name))
    def prop(data: bytes) -> None:
        fuzz_targets.check(targets[name], data)

    prop()
