"""The code's shape, checked on its syntax trees (docs/architecture.md): an acyclic import graph with no upward
imports, torch.distributed confined to shardtune.parallel, short functions and files, few parameters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardtune

ROOT = Path(shardtune.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 550  # 600 before the root's grab-bags were split into packages
MAX_PARAMETERS = 12
# Functions allowed more parameters, each with why (keep it short: a function's settings belong in one structure,
# as the planner's in planning.inputs.PlanInputs).
MANY_PARAMETERS = {
    "shardtune.training.trainer.train": "the loop's parts (model, optimizer, scheduler, splits, state, logger, hooks): not settings",
    "shardtune.planning.estimate._dynamic": "the activation terms' inputs, each derived from PlanInputs by "
    "_dynamic_kwargs and passed as one dict",
}
# The packages by role, lowest first (docs/architecture.md): a module imports only its own role's modules and
# those of the roles before it.
ROLES = (
    ("shardtune.runtime",),
    ("shardtune.config",),
    ("shardtune.data",),
    ("shardtune.models",),
    ("shardtune.parallel",),
    ("shardtune.objectives",),
    ("shardtune.training",),
    ("shardtune.planning", "shardtune.merge", "shardtune.inference", "shardtune.rl"),
    ("shardtune.recipe",),
    ("shardtune.commands", "shardtune.cli", "shardtune.__main__"),
)
# Roles of one rank that are independent of each other.
SIBLINGS = ("shardtune.planning", "shardtune.merge", "shardtune.inference", "shardtune.rl")
# Facts any role may read: they import nothing of shardtune but the logger.
LEAVES = (
    "shardtune.config.dtypes",
    "shardtune.config.precision",
    "shardtune.parallel.dims",
    "shardtune.parallel.split",
    "shardtune.runtime.hooks",
    "shardtune.runtime.log",
    "shardtune.runtime.atomic",
)
# Modules that still import a later role, each with why; an entry that no longer needs it is removed.
UPWARD: dict[str, str] = {}


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
            submodules = {f"{module}.{a.name}" for a in node.names} & MODULES.keys()  # `from pkg import submodule`
            # Importing only submodules of a package runs its __init__, whose own imports are its own edges.
            found |= submodules if len(submodules) == len(node.names) else submodules | {module}
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
    assert "shardtune.recipe.train" in GRAPH["shardtune.commands.train"]
    assert "shardtune.parallel.setup" in GRAPH["shardtune.recipe.build"]
    assert "shardtune.models.builder" in GRAPH["shardtune.parallel.setup"]
    assert "shardtune.recipe.state" in GRAPH["shardtune.recipe.checks"]
    assert len(MODULES) > 40


def test_no_import_cycles():
    assert _cycles() == []


def test_a_cycle_would_be_found(monkeypatch):
    monkeypatch.setitem(
        GRAPH, "shardtune.config.dtypes", GRAPH["shardtune.config.dtypes"] | {"shardtune.commands.train"}
    )
    assert any("shardtune.config.dtypes" in c and "shardtune.commands.train" in c for c in _cycles())


def _role(name: str) -> int:
    return next(rank for rank, prefixes in enumerate(ROLES) if _under(name, prefixes))


def _upward_imports() -> dict[str, list[str]]:
    """{module: the later roles' modules it imports}, and every import of a leaf that is not the logger."""
    wrong: dict[str, list[str]] = {}
    for name, targets in GRAPH.items():
        for target in sorted(targets):
            later = _role(target) > _role(name) and not _under(target, LEAVES)
            sibling = _under(name, SIBLINGS) and _under(target, SIBLINGS) and target.split(".")[1] != name.split(".")[1]
            leaf = _under(name, LEAVES) and target != "shardtune.runtime.log"
            if later or sibling or leaf:
                wrong.setdefault(name, []).append(target)
    return wrong


def test_every_module_has_a_role():
    assert [n for n in MODULES if not any(_under(n, p) for roles in ROLES for p in [roles])] == ["shardtune"]


def test_no_upward_imports():
    assert sorted(set(_upward_imports()) - set(UPWARD)) == []
    assert sorted(set(UPWARD) - set(_upward_imports())) == []


def test_an_upward_import_would_be_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "shardtune.parallel.dims", GRAPH["shardtune.parallel.dims"] | {"shardtune.config.run"})
    monkeypatch.setitem(
        GRAPH, "shardtune.parallel.mesh", GRAPH["shardtune.parallel.mesh"] | {"shardtune.commands.train"}
    )
    monkeypatch.setitem(GRAPH, "shardtune.merge.plan", GRAPH["shardtune.merge.plan"] | {"shardtune.planning.model"})
    monkeypatch.setitem(GRAPH, "shardtune.data.cache", GRAPH["shardtune.data.cache"] | {"shardtune.models.weights"})
    found = _upward_imports()
    assert found["shardtune.parallel.dims"] == ["shardtune.config.run"]
    assert found["shardtune.parallel.mesh"] == ["shardtune.commands.train"]
    assert found["shardtune.merge.plan"] == ["shardtune.planning.model"]
    assert found["shardtune.data.cache"] == ["shardtune.models.weights"]


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


# Libraries shardtune imports inside the functions that need them, and why (an import at module top shows the
# dependency; these would cost every command their start-up time, or are optional extras).
LAZY_LIBRARIES = {
    "transformers": "seconds to import: --help, the planner's arithmetic and the data workers start without it",
    "peft": "imports transformers",
    "datasets": "seconds to import (pyarrow): only where a split is read",
    "torch": "seconds to import: the planner's arithmetic, the launcher and --help run without it",
    "huggingface_hub": "the hub client: only for hub ids and uploads",
    "bitsandbytes": "optional: the qlora extra",
    "lm_eval": "optional: the eval extra",
    "wandb": "optional: the wandb extra",
    "mlflow": "optional: the mlflow extra",
    "matplotlib": "optional: the report extra",
    "flash_attn": "optional: flash-attention, on CUDA only",
}


def _unexplained_local_imports(name: str, source: str) -> list[str]:
    """Imports inside a function with no comment (on the line or the one above) saying why, of shardtune modules
    or of a library not in LAZY_LIBRARIES. torch's submodules (torch.distributed's tools, fake tensors, private
    helpers) count as torch."""
    lines, wrong = source.split("\n"), []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            module = node.names[0].name if isinstance(node, ast.Import) else module
            if module is None or getattr(node, "level", 0):
                continue
            said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
            if not said and module.split(".")[0] not in LAZY_LIBRARIES:
                wrong.append(f"{name}:{node.lineno} imports {module} in {func.name}")
    return wrong


def test_local_imports_say_why():
    assert [w for name, path in MODULES.items() for w in _unexplained_local_imports(name, path.read_text())] == []


def test_an_unexplained_local_import_would_be_found():
    source = (
        "def f():\n    from shardtune.runtime.log import warn0\n    import json\n    import torch\n\n\n"
        "def g():\n    import shardtune.x  # why\n"
    )
    assert _unexplained_local_imports("m", source) == [
        "m:2 imports shardtune.runtime.log in f",
        "m:3 imports json in f",
    ]


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
