"""The run's configuration, read and checked whole: the first part of `shardtune train`, and what `launch` and `plan`
check of the same flags.

The configuration checks its own rules (shardtune.config.validation: ranges, flags that exclude or need each other,
the folders named). A flag whose values a component defines is checked by that component, from its registry: the
data sources (--dataset_name), the objectives (--objective and the knobs each reads), the optimizers (--optim), the
trackers (--report_to) and the 4-bit rules. This module asks each of them, so that a run hears of every problem at
once, each naming its flag and the fix, before any data or model is loaded; adding an optimizer or an objective
changes its registry alone. The model's files are checked after this, by shardtune.models.preflight.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardtune.config.arguments import FLAG_DEFAULTS, RunConfig
from shardtune.config.errors import ConfigError
from shardtune.config.run import parse_run_config
from shardtune.config.validation import flag_problems
from shardtune.data.sources import dataset_problems
from shardtune.models.quant import quantization_problems
from shardtune.objectives.loss import apply_objective_defaults, objective_problems, objectives_help
from shardtune.rl.checks import rl_problems
from shardtune.training import optimizers
from shardtune.training.trackers import report_to_problems


def flag_choices() -> dict[str, str]:
    """The values of the flags a registry holds, for --help (read when the parser is built, so that an optimizer or
    objective registered by a plugin before the command runs is listed too)."""
    return {"objective": objectives_help(), "optim": f"{optimizers.names()}."}


def run_problems(cfg: RunConfig, check_paths: bool = True) -> list[str]:
    """Every problem of a run's flags: the configuration's own, then each component's. `check_paths`: also that the
    model, adapter and data the flags name exist (shardtune plan leaves them out: it reads a config.json alone)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p = flag_problems(cfg, check_paths=check_paths)
    p += dataset_problems(d.dataset_name, check_paths=check_paths)
    p += optimizers.name_problems(t.optim)
    p += report_to_problems(t.report_to)
    p += objective_problems(t, d, FLAG_DEFAULTS)
    p += rl_problems(cfg)
    p += quantization_problems(
        use_4bit=m.use_4bit_quantization,
        use_8bit=m.use_8bit_quantization,
        quant_storage_dtype=m.bnb_4bit_quant_storage_dtype,
        precision=cfg.precision,
        fsdp_enabled=cfg.fsdp.enabled,
        compute_dtype=m.bnb_4bit_compute_dtype,
    )
    return p


def validate(cfg: RunConfig, check_paths: bool = True, not_needed: tuple[str, ...] = ()) -> None:
    """Raise ConfigError listing every problem of `run_problems`, if any, but those that begin with one of
    `not_needed` (what a caller does not need: `shardtune plan` reads no dataset and runs no reward function)."""
    if problems := [p for p in run_problems(cfg, check_paths=check_paths) if not p.startswith(not_needed)]:
        raise ConfigError(problems)


def complete_run_config(cfg: RunConfig, check_paths: bool = True, not_needed: tuple[str, ...] = ()) -> RunConfig:
    """The parsed configuration made whole and checked, the same way for `shardtune train` (load_run_config) and
    `shardtune plan`: the objective's own defaults where the run did not give them (e.g. GRPO's beta 0 and
    loss_type dapo), then every problem at once (validate)."""
    apply_objective_defaults(cfg.train, cfg.explicit)
    validate(cfg, check_paths=check_paths, not_needed=not_needed)
    return cfg


def load_run_config(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> RunConfig:
    """Flags (or a run file) + the launcher's environment → a checked RunConfig (raises ConfigError listing every
    problem)."""
    return complete_run_config(parse_run_config(argv, env, choices=flag_choices()))
