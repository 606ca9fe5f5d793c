"""`shardtune train`'s GPU-size warning and `shardtune plan` read one translation of a run's flags into the
planner's inputs, in shardtune.planning.fit; the plan command's module is imported by the CLI alone (the recipe
reads the planner, not another command)."""

from __future__ import annotations

from shardtune.commands import plan
from shardtune.planning import fit
from tests.unit.test_structure import GRAPH


def test_only_the_cli_imports_the_plan_command():
    assert (
        sorted(n for n, targets in GRAPH.items() if "shardtune.commands.plan" in targets and n != "shardtune.cli") == []
    )


def test_train_and_plan_read_the_same_planner_inputs():
    assert "shardtune.planning.fit" in GRAPH["shardtune.recipe.settings"]  # train's start-up plan
    assert "shardtune.planning.fit" in GRAPH["shardtune.commands.plan"]
    # docs/plan.md names shardtune.commands.plan.warn_if_too_small: the same function, not a copy.
    assert (plan.warn_if_too_small, plan.plan_inputs, plan.plan_shape) == (
        fit.warn_if_too_small,
        fit.plan_inputs,
        fit.plan_shape,
    )
