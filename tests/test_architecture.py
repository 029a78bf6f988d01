"""The shape of the package (docs/architecture.md): dependencies run one way, no import cycles
(deferred imports inside functions included), files stay readable, and every list of policy names
comes from the registry."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mergestream.policies import RECOMMENDED_POLICY, REGISTRY, parameter_names, policy_names

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mergestream"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(importer: str, is_pkg: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph() -> dict[str, set[str]]:
    """Every mergestream module -> the mergestream modules it imports anywhere (module level,
    inside functions, under TYPE_CHECKING), ``from pkg import submodule`` resolved to the submodule."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(name, is_pkg, node.level, node.module)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in MODULES:  # `import a.b.c` of an attribute path: its module
                    t = t.rpartition(".")[0]
                if t.startswith("mergestream") and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycles_deferred_ones_included():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_deferred_cycle():
    """The check above can fail: a function-level import back up is a cycle."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


LOWER = ["mergestream.engine", "mergestream.engine.folding", "mergestream.engine.unmerge", "mergestream.engine.passes",
         "mergestream.policies", "mergestream.io.checkpoints", "mergestream.io.expert_readers", "mergestream.datasteps.ri",
         "mergestream.experts", "mergestream.datasteps.text", "mergestream.datasteps.distill", "mergestream.io.st", "mergestream.engine.stream", "mergestream.io.writers",
         "mergestream.engine.residuals", "mergestream.patches", "mergestream.patches.build", "mergestream.engine.inspection",
         "mergestream.io.state", "mergestream.config", "mergestream.engine.fold_tensor", "mergestream.engine.executors",
         "mergestream.engine.executors.recording",
         "mergestream.io.versions", "mergestream.feed.build", "mergestream.feed.plan", "mergestream.feed.layout",
         "mergestream.feed.keys", "mergestream.agent.pull", "mergestream.agent.cli"]


@pytest.mark.parametrize("module", [m for m in LOWER if m in MODULES])
def test_dependencies_run_one_way(module):
    """Nothing below the daemon imports the daemon or the CLI, directly or through another module."""
    graph = import_graph()
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(graph.get(m, ()))
    upward = sorted(m for m in seen if m.startswith(("mergestream.daemon", "mergestream.cli", "mergestream.demo")))
    assert not upward, f"{module} reaches {upward}"


def test_policies_import_nothing_but_their_errors():
    """... the torch-free constants of the recommended policy, which the config reads without them,
    and the settings base their parameters share with the config."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("mergestream.policies"):
            outside = {e for e in edges if not e.startswith("mergestream.policies")}
            assert outside <= {"mergestream.errors", "mergestream.recommended", "mergestream.settings_base"}, \
                f"{name} imports {outside}"


def test_only_the_ray_executor_imports_ray():
    """Ray is an optional extra: one module imports it (anywhere in the file), and importing the
    engine, the CLI or the daemon does not load it."""
    importers = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(m == "ray" or m.startswith("ray.") for m in mods):
                importers.add(name)
    assert importers == {"mergestream.engine.executors.ray_cluster"}
    code = ("import sys\nimport mergestream.engine, mergestream.cli, mergestream.daemon.service, mergestream.engine.executors\n"
            "assert 'ray' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_runtime_import_of_lower_layers_loads_no_daemon():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LOWER if m in MODULES) +
            "bad = sorted(m for m in sys.modules if m.startswith(('mergestream.daemon', 'mergestream.cli')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


#: what imports no torch, so a device or a CI job without it can use it: the I/O layer's format
#: modules (the tensor readers and writers in io/ are the engine's and need torch), the patch apply
#: side, the whole feed package (the fleet contract and the publisher) and the device agent
TORCH_FREE = sorted(m for m in MODULES if m in {"mergestream", "mergestream.io", "mergestream.io.st", "mergestream.io.paths",
                                                 "mergestream.io.versions", "mergestream.patches",
                                                 "mergestream.patches.codec", "mergestream.patches.build",
                                                 "mergestream.io.model_card", "mergestream.recommended",
                                                 "mergestream.settings_base",
                                                 # what the ledger verbs (status, history, rollback) load
                                                 "mergestream.config", "mergestream.config_policy",
                                                 "mergestream.daemon.ledger",
                                                 "mergestream.daemon.store", "mergestream.daemon.notes"}
                    or m.startswith(("mergestream.feed", "mergestream.agent")))


def test_torch_free_parts_import_no_torch_in_a_fresh_interpreter():
    """Each module of :data:`TORCH_FREE` imports (every one, in one fresh interpreter) with torch
    blocked: ``import torch`` anywhere on the way raises, as on a machine without it."""
    assert {"mergestream.io.st", "mergestream.feed.build", "mergestream.feed.plan", "mergestream.agent.cli"} <= set(TORCH_FREE)
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ModuleNotFoundError('torch is blocked', name=name)\n"
            "sys.meta_path.insert(0, Block())\n"
            + "".join(f"import {m}\n" for m in TORCH_FREE) + "assert 'torch' not in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_agent_imports_only_the_fleet_contract_patches_st_and_errors():
    allowed = ("mergestream.agent", "mergestream.feed.layout", "mergestream.feed.plan", "mergestream.patches",
               "mergestream.io.st", "mergestream.io.paths", "mergestream.errors")
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("mergestream.agent"):
            # a package import also runs its __init__: mergestream, mergestream.io, mergestream.feed
            outside = {e for e in edges if not e.startswith(allowed) and e not in ("mergestream", "mergestream.io",
                                                                                   "mergestream.feed")}
            assert not outside, f"{name} imports {outside}"


def test_nothing_but_the_agent_imports_the_agent():
    """The fleet contract lives in feed/: the agent imports it, never the reverse, and nothing
    else of the package (the daemon, the CLI, the feed builder) reaches into the agent."""
    graph = import_graph()
    for name, edges in graph.items():
        if not name.startswith("mergestream.agent"):
            into = {e for e in edges if e.startswith("mergestream.agent")}
            assert not into, f"{name} imports {into}"


def test_the_feed_reads_versions_without_the_daemon():
    """feed/ (the builder included) imports neither the daemon nor the agent; only its command
    group reads the daemon's config (``feed build --config``)."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("mergestream.feed"):
            up = {e for e in edges if e.startswith(("mergestream.daemon", "mergestream.agent", "mergestream.cli"))}
            assert not up, f"{name} imports {up}"
            if name != "mergestream.feed.cli":
                assert "mergestream.config" not in edges, f"{name} imports mergestream.config"


def test_package_root_holds_at_most_15_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 15, root


def test_no_file_in_the_package_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


# -- every list of policy names comes from the registry ------------------------------------------------
def _docs_policy_rows() -> dict[str, str]:
    """The rows of the overview table on docs/policies.md (the page that replaced the README's table)."""
    text = (ROOT / "docs" / "policies.md").read_text()
    table = text.split("\n\n| policy | source |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        if m := re.match(r"\| `(\w+)` \|(.*)", line):
            rows[m[1]] = m[2]
    return rows


def test_docs_policy_table_is_the_registry():
    """docs/policies.md's overview names every registered policy once, in registry order; the
    parameters are on the generated reference page (tests/test_docs_site.py checks each appears)."""
    assert list(_docs_policy_rows()) == policy_names()


def test_every_config_key_and_policy_parameter_has_a_description():
    """The generated reference pages (docs/_gen/reference.py) print each field's description: a
    key without one would be an undocumented key on the site."""
    from pydantic import BaseModel

    from mergestream.config import Config

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            subs = [a for a in (field.annotation, *typing.get_args(field.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
            if subs:
                yield from walk(subs[0], f"{prefix}{name}.")
            elif not field.description:
                yield prefix + name

    assert list(walk(Config)) == []
    for name, cls in REGISTRY.items():
        missing = [n for n, f in cls.Params.model_fields.items() if not f.description]
        assert not missing, f"{name}: {missing}"


def test_cli_choices_and_starter_config_come_from_the_registry(tmp_path):
    from click.testing import CliRunner

    from mergestream.cli import cli
    from mergestream.config import load_config
    from mergestream.starter import write_starter

    help_text = CliRunner().invoke(cli, ["fold", "--help"]).output
    assert "|".join(policy_names()) in help_text
    bad = CliRunner().invoke(cli, ["merge", "--base", "b", "--policy", "no_such_policy", "--out", "o", "e"])
    assert bad.exit_code == 2 and "no_such_policy" in bad.output and "task_arithmetic" in bad.output
    base = tmp_path / "base.safetensors"
    base.write_bytes(b"")
    text = write_starter(tmp_path / "d", str(base)).read_text()
    for name in REGISTRY:
        assert f"#   {name}: {', '.join(parameter_names(name)) or '(no parameters)'}\n" in text
    assert load_config(tmp_path / "d" / "config.yaml").policy.name == RECOMMENDED_POLICY


def test_no_package_face_shadows_one_of_its_modules():
    """A package's ``__init__`` that re-exports a function named like one of its modules (the
    ``distill`` function of ``datasteps/distill.py``) makes ``import mergestream.datasteps.distill as m``
    give the function: every submodule's name on its package is the module."""
    import importlib
    import types

    shadowed = []
    for name, path in MODULES.items():
        if path.name == "__init__.py" or name.count(".") < 2:
            continue
        parent, _, leaf = name.rpartition(".")
        importlib.import_module(name)
        if not isinstance(getattr(importlib.import_module(parent), leaf), types.ModuleType):
            shadowed.append(name)
    # the one kept on purpose: `engine.unmerge` is the verb every caller uses (engine/__init__.py)
    assert shadowed == ["mergestream.engine.unmerge"]
