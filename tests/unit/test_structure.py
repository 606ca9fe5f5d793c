"""The code's shape, checked on its syntax trees (docs/architecture.md): an acyclic import graph with no upward
imports, torch.distributed confined to shardtune.parallel, short functions and files, few parameters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardtune

ROOT = Path(shardtune.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
MAX_PARAMETERS = 12
# Functions allowed more parameters, each with why (keep it short: a function's settings belong in one structure,
# as the planner's in planning.inputs.PlanInputs).
MANY_PARAMETERS = {
    "shardtune.trainer.train": "the loop's parts (model, optimizer, scheduler, splits, state, logger, hooks): not settings",
    "shardtune.planning.estimate._dynamic": "the activation terms' inputs, each derived from PlanInputs by "
    "_dynamic_kwargs and passed as one dict",
}
# The commands' own modules (shardtune.cli's table) and the recipe's parts: nothing below them imports them.
COMMANDS = (
    "shardtune.cli",
    "shardtune.__main__",
    "shardtune.train",
    "shardtune.plan",
    "shardtune.launch",
    "shardtune.merge",
    "shardtune.chat",
    "shardtune.demo",
    "shardtune.recipe",
)
# Modules that hold one kind of fact each; they import nothing of shardtune but the logger.
LEAVES = (
    "shardtune.dtypes",
    "shardtune.precision",
    "shardtune.parallel.dims",
    "shardtune.hooks",
    "shardtune.log",
    "shardtune.atomic",
)
LOWER_PACKAGES = ("shardtune.parallel", "shardtune.planning", "shardtune.data")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every shardtune module `name` imports, at module level or inside a function (both are edges: a local
    import that avoids a cycle at import time is still a cycle in the design)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    """The checks below would pass on an empty graph: make sure the parser sees known edges."""
    assert "shardtune.parallel.setup" in GRAPH["shardtune.train"]
    assert "shardtune.builder" in GRAPH["shardtune.parallel.setup"]
    assert "shardtune.recipe.state" in GRAPH["shardtune.recipe.checks"]
    assert len(MODULES) > 40


def test_no_import_cycles():
    assert _cycles() == []


def test_a_cycle_would_be_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "shardtune.dtypes", GRAPH["shardtune.dtypes"] | {"shardtune.train"})
    assert any("shardtune.dtypes" in c and "shardtune.train" in c for c in _cycles())


def _upward_imports() -> list[str]:
    wrong = []
    for name, targets in GRAPH.items():
        for target in targets:
            if _under(target, COMMANDS) and not _under(name, COMMANDS) and name != "shardtune.cli":
                wrong.append(f"{name} imports the command module {target}")
            if _under(name, LEAVES) and target != "shardtune.log":
                wrong.append(f"{name} (a leaf) imports {target}")
            if _under(name, LOWER_PACKAGES) and _under(target, COMMANDS):
                wrong.append(f"{name} imports {target}")
    return wrong


def test_no_upward_imports():
    assert _upward_imports() == []


def test_an_upward_import_would_be_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "shardtune.parallel.dims", GRAPH["shardtune.parallel.dims"] | {"shardtune.config"})
    monkeypatch.setitem(GRAPH, "shardtune.parallel.mesh", GRAPH["shardtune.parallel.mesh"] | {"shardtune.train"})
    assert set(_upward_imports()) >= {
        "shardtune.parallel.dims (a leaf) imports shardtune.config",
        "shardtune.parallel.mesh imports shardtune.train",
    }


def _torch_distributed_uses(name: str, source: str) -> list[str]:
    wrong = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        wrong += [f"{name}: {n}" for n in names if n == "torch.distributed" or n.startswith("torch.distributed.")]
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed."):
            wrong.append(f"{name}: {ast.unparse(node)}")
    return wrong


# The parallel package's facts, which configuration code reads: no torch.distributed there either.
PARALLEL_FACTS = ("shardtune.parallel", "shardtune.parallel.dims", "shardtune.parallel.split")


def test_only_shardtune_parallel_imports_torch_distributed():
    wrong = []
    for name, path in MODULES.items():
        if _under(name, ("shardtune.parallel",)) and name not in PARALLEL_FACTS:
            continue
        wrong += _torch_distributed_uses(name, path.read_text())
    assert wrong == []


def test_a_torch_distributed_use_would_be_found():
    assert _torch_distributed_uses("m", "import torch.distributed as dist\n") == ["m: torch.distributed"]
    assert _torch_distributed_uses("m", "from torch.distributed.tensor import DTensor\n")
    assert _torch_distributed_uses("m", "import torch\nx = torch.distributed.get_rank()\n")
    assert _torch_distributed_uses("m", "import torch\nx = torch.cuda.device_count()\n") == []


@pytest.mark.parametrize("limit", [MAX_FUNCTION_LINES])
def test_no_long_functions(limit):
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert long == []


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional and keyword parameters, self and cls aside (*args and **kwargs are not counted)."""
    a = node.args
    return sum(p.arg not in ("self", "cls") for p in [*a.posonlyargs, *a.args, *a.kwonlyargs])


def test_no_function_takes_many_parameters():
    """No function of shardtune takes more than MAX_PARAMETERS parameters, but those of MANY_PARAMETERS; an entry
    there that no longer needs it is removed."""
    many = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > MAX_PARAMETERS:
                many[f"{name}.{node.name}"] = _parameters(node)
    assert sorted(set(many) - set(MANY_PARAMETERS)) == []
    assert sorted(set(MANY_PARAMETERS) - set(many)) == []


def test_no_long_files():
    long = [
        f"{name}: {n} lines"
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert long == []


def test_architecture_doc_names_every_module():
    """docs/architecture.md is the map of the code: a new module gets its line there."""
    doc = (ROOT.parents[1] / "docs" / "architecture.md").read_text()
    modules = [p.relative_to(ROOT) for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    missing = [str(m) for m in modules if f"`{m.name}`" not in doc and f"`{m}`" not in doc]
    assert missing == []
