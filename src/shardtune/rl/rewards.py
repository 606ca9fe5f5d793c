"""The reward functions of --objective grpo, named, checked and called as TRL's GRPOTrainer calls them.

--reward_funcs names each as a built-in (`BUILTINS`), `module:function` (importable; the working directory is searched
too, as by TRL's CLI) or `path/to/file.py:function` (loaded by path); --reward_weights weighs them (1.0 each). Each is
called once per batch of N completions with TRL 1.16's keywords (`GRPOTrainer._calculate_rewards`), and returns N
numbers, None where it does not apply to a row:

    fn(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=, log_metric=)

`prompts` are strings, or lists of chat messages for a conversational dataset, whose `completions` are then
`[{"role": "assistant", "content": text}]`; `completion_ids` the completions' token ids; `columns` every other
dataset column (not prompt/completion/completion_ids). TRL's `trainer_state` is its TrainerState: here whatever the
loop gives `compute_rewards` (None by default), always passed so that a function naming it runs. `log_extra(column,
values)` and `log_metric(name, value)` log into a `RewardLog`. TRL's `environments` is not passed. An async function
is awaited. None becomes NaN, left out of the row's total (`combine_rewards`, as TRL). Any other non-finite or
non-number, an exception (re-run row by row to name the first failing row) and a call slower than --reward_timeout (a
SIGALRM timer, `_Deadline`: in the main thread only) raise `RewardError`: one line naming the function, row and fix.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardtune.runtime.log import warn0
from shardtune.runtime.signals import importing

# How soon a deadline that fell inside an import tries again (an exception raised there may abort the process:
# shardtune.runtime.signals).
_RETRY_S = 0.01
# math_answer's bounds on one parse and one comparison (TRL's accuracy_reward: 10 s and 5 s): an expression that
# takes longer counts as unparsed, or as a wrong answer.
_PARSE_S, _VERIFY_S = 10.0, 5.0
_EXCERPT = 40  # characters of a prompt quoted in a message
_LATE = object()  # a reward function's result when it ran past --reward_timeout
_KEYWORDS = "prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric= and each dataset column"


@dataclass(frozen=True)
class RewardFunction:
    name: str  # as the user wrote it, for messages; metrics use the function's __name__, as TRL's
    fn: Callable
    weight: float


class RewardError(RuntimeError):
    """A reward function failed on a batch; str() is the one line a user sees (the function, the row, the fix)."""


@dataclass
class RewardLog:
    """What reward functions logged through TRL's `log_extra` and `log_metric` during `compute_rewards`."""

    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))


class _Expired(BaseException):
    """_Expired(deadline): it passed (BaseException: a reward function's `except Exception` does not swallow it)."""


class _Deadline:
    """Raises `_Expired(self)` in the main thread `seconds` after entering (ITIMER_REAL and SIGALRM), then puts back
    the SIGALRM handler and the timer it found, less the time spent: deadlines nest, and an inner one never delays an
    outer one (the outer's handler runs when its time comes first). No deadline when `seconds` is None or <= 0, or
    off the main thread (Python runs signal handlers there alone). `expired` tells whether it fired, for a function
    that swallowed `_Expired` with a bare `except:`."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.expired = False

    def __enter__(self):
        self._armed = bool(self.seconds and self.seconds > 0) and threading.current_thread() is threading.main_thread()
        if not self._armed:
            return self
        now = time.monotonic()
        self._previous = signal.getsignal(signal.SIGALRM)
        outer, _ = signal.getitimer(signal.ITIMER_REAL)
        self._outer_end = now + outer if outer > 0 else math.inf
        self._mine_first = now + self.seconds < self._outer_end
        self._outer_fired = False
        signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, min(self.seconds, self._outer_end - now))
        return self

    def _fire(self, signum, frame) -> None:
        if not self._mine_first:  # the outer timer's time: its own handler's business (it may raise)
            self._outer_fired = True
            if callable(self._previous):
                self._previous(signum, frame)
            if (again := signal.getitimer(signal.ITIMER_REAL)[0]) > 0:  # it set its timer again (an import: later)
                self._outer_end, self._outer_fired = time.monotonic() + again, False
            return
        if importing(frame):
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        self.expired = True
        raise _Expired(self)

    def __exit__(self, *exc) -> bool:
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            # None: a handler not installed from Python, which cannot be put back; the default is the closest.
            signal.signal(signal.SIGALRM, signal.SIG_DFL if self._previous is None else self._previous)
            if self._outer_end < math.inf and not self._outer_fired:
                signal.setitimer(signal.ITIMER_REAL, max(self._outer_end - time.monotonic(), 1e-6))
        return False


def bounded(seconds: float | None, fn: Callable, default, *args, **kwargs):
    """`fn(*args, **kwargs)`, or `default` when it runs longer than `seconds` (a nested `_Deadline`; also when `fn`
    swallowed the deadline's `_Expired` and returned late)."""
    deadline = _Deadline(seconds)
    try:
        with deadline:
            result = fn(*args, **kwargs)
    except _Expired as e:
        if e.args[0] is not deadline:
            raise
        return default
    return default if deadline.expired else result


# TRL's think_format_reward (trl/rewards/format_rewards.py), same pattern and flags: the completion opens with
# <think>, closes it, and has no second <think>.
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def content_text(value) -> str:
    """The text of a prompt or completion: a string itself; a list of chat messages, its last message's content (a
    list of content parts: their texts joined)."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content", "")
        if isinstance(value, list):
            return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return value if isinstance(value, str) else str(value)


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), if any."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normal(text: str) -> str:
    """Case folded, whitespace collapsed, a trailing period dropped; a number without $ and thousands commas."""
    text = " ".join(text.casefold().split()).rstrip(".").strip()
    return text.replace("$", "").replace(",", "") if _NUMBER.fullmatch(text) else text


def gold_answer(value) -> str:
    """A row's answer column: its text, after the last `####` when it has one (GSM8K's solutions)."""
    text = str(value)
    return _normal(text.rpartition("####")[2] if "####" in text else text)


def final_answer(text: str, numeric: bool) -> str:
    """A completion's final answer, the first of: the content of its last <answer>...</answer>; of its last
    \\boxed{...}; the text after its last `####`; then, when the gold answer is a number, the last number in it, else
    its last non-empty line. Normalised as the gold answer (`_normal`)."""
    if found := _ANSWER_TAG.findall(text):
        return _normal(found[-1])
    if (boxed := _boxed(text)) is not None:
        return _normal(boxed)
    if "####" in text:
        return _normal(text.rpartition("####")[2])
    if numeric:
        numbers_found = _NUMBER.findall(text)
        return _normal(numbers_found[-1]) if numbers_found else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return _normal(lines[-1]) if lines else ""


def _same(answer: str, gold: str) -> bool:
    if _NUMBER.fullmatch(answer) and _NUMBER.fullmatch(gold):
        return float(answer) == float(gold)
    return answer == gold


def _golds(answer: list | None, solution: list | None, n: int) -> list:
    """The gold answers: the `answer` column, else `solution`, else None for every row."""
    return answer if answer is not None else solution if solution is not None else [None] * n


def format_reward(completions: list, **kwargs) -> list[float]:
    """`format`: 1.0 when the completion opens with a <think>...</think> block (TRL's think_format_reward)."""
    return [1.0 if _THINK.match(content_text(c)) else 0.0 for c in completions]


def exact_answer_reward(completions: list, answer: list | None = None, solution: list | None = None, **kwargs):
    """`exact_answer`: 1.0 when the completion's `final_answer` equals the row's `answer` column (else `solution`,
    TRL's math datasets'), read by `gold_answer`, after case, whitespace and a trailing period; two numbers compare
    as numbers (`1,000` = `1000.0`). None for a row without either column (or with None there)."""
    out = []
    for c, g in zip(completions, _golds(answer, solution, len(completions)), strict=True):
        gold = None if g is None else gold_answer(g)
        numeric = gold is not None and _NUMBER.fullmatch(gold) is not None
        out.append(None if gold is None else float(_same(final_answer(content_text(c), numeric), gold)))
    return out


def math_answer_reward(completions: list, answer: list | None = None, solution: list | None = None, **kwargs):
    """`math_answer`: TRL's accuracy_reward through math-verify: 1.0 when the completion's LaTeX answer (a \\boxed{}
    first) is mathematically equal to the row's `answer` (else `solution`) column; None where that column is missing
    or does not parse. Each parse and comparison is bounded (`_PARSE_S`, `_VERIFY_S`) by a nested deadline instead of
    math-verify's own SIGALRM timers, which would cancel --reward_timeout's."""
    from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify  # optional: math-verify

    for name in ("math_verify.parser", "math_verify.grader"):  # its "timeout is disabled" notice: ours bounds it
        logging.getLogger(name).setLevel(logging.ERROR)
    # TRL's extraction of the completion's answer: LaTeX only, a \boxed{} first, units normalised.
    latex = LatexExtractionConfig(
        normalization_config=LatexNormalizationConfig(units=True),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    out = []
    for c, g in zip(completions, _golds(answer, solution, len(completions)), strict=True):
        gold = [] if g is None else bounded(_PARSE_S, parse, [], str(g), parsing_timeout=None)
        found = {"extraction_config": [latex], "extraction_mode": "first_match", "parsing_timeout": None}
        pred = bounded(_PARSE_S, parse, [], content_text(c), **found) if gold else []
        out.append(float(bounded(_VERIFY_S, verify, False, gold, pred, timeout_seconds=None)) if gold else None)
    return out


BUILTINS: dict[str, Callable] = {
    "format": format_reward,
    "exact_answer": exact_answer_reward,
    "math_answer": math_answer_reward,
}
# A built-in's optional dependency: (import name, what to pip install).
_NEEDS = {"math_answer": ("math_verify", "math-verify")}


def builtin_names() -> str:
    return ", ".join(BUILTINS)


_FORMS = "a built-in ({builtins}), module:function, or path/to/file.py:function"
_FILE_MODULES: dict[Path, object] = {}  # a file's module, loaded once (reward_problems, then load_reward_functions)


def _import_module(spec: str, module: str):
    """(the module, None) or (None, the problem)."""
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # as TRL's CLI: a module beside the command is found
    try:
        return importlib.import_module(module), None
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            return None, (
                f"--reward_funcs {spec!r}: module {module!r} not found (from {cwd}); install it, or name its file "
                "as path/to/file.py:function"
            )
        return None, f"--reward_funcs {spec!r}: importing {module!r} raised {_short(e)}; install what it imports"
    except Exception as e:  # noqa: BLE001 - whatever the module's code raises is the user's to fix
        return None, f"--reward_funcs {spec!r}: importing {module!r} raised {_short(e)}; fix the module"


def _load_file(spec: str, location: str):
    """(the file's module, None) or (None, the problem). Loaded once per path, under a name of its own."""
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        return None, f"--reward_funcs {spec!r}: file {location!r} not found (from {Path.cwd()}); give a file's path"
    if path in _FILE_MODULES:
        return _FILE_MODULES[path], None
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_shardtune_reward_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look a function's module up there
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # the file's own imports of modules beside it, as when run as a script
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the file's code raises is the user's to fix
        del sys.modules[name]
        return None, f"--reward_funcs {spec!r}: loading {location!r} raised {_short(e)}; fix the file"
    _FILE_MODULES[path] = module
    return module, None


def _signature_problem(spec: str, fn: Callable) -> str | None:
    """TRL's call passes every column as a keyword: a function must take **kwargs."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: left to the call
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return f"--reward_funcs {spec!r}: the function takes no **kwargs, but is called with {_KEYWORDS}; add **kwargs"


def _resolve(spec: str) -> tuple[Callable | None, str | None]:
    """(the function, None) or (None, the one problem of `spec`)."""
    forms = _FORMS.format(builtins=builtin_names())
    if ":" not in spec:
        if spec in BUILTINS:
            module, package = _NEEDS.get(spec, (None, None))
            if module and importlib.util.find_spec(module) is None:
                return None, f"--reward_funcs {spec!r} needs the {package} package; install it: pip install {package}"
            return BUILTINS[spec], None
        hint = f" (did you mean {spec.rpartition('.')[0] + ':' + spec.rpartition('.')[2]!r}?)" if "." in spec else ""
        return None, f"--reward_funcs {spec!r}: no built-in reward of that name{hint}; give {forms}"
    location, _, attr = spec.rpartition(":")
    if not location or not attr.isidentifier():
        return None, f"--reward_funcs {spec!r}: give {forms}"
    is_file = location.endswith(".py") or "/" in location or "\\" in location
    module, problem = _load_file(spec, location) if is_file else _import_module(spec, location)
    if problem:
        return None, problem
    if not hasattr(module, attr):
        own = [n for n, v in vars(module).items() if callable(v) and getattr(v, "__module__", 0) == module.__name__]
        own = [n for n in own if not n.startswith("_")]
        defined = ", ".join(own[:8]) + (", ..." if len(own) > 8 else "") if own else "no function"
        return None, f"--reward_funcs {spec!r}: {location!r} has no {attr!r} (it defines: {defined}); name one of them"
    fn = getattr(module, attr)
    if not callable(fn):
        return None, f"--reward_funcs {spec!r}: {attr!r} is a {type(fn).__name__}, not a function; name a function"
    return fn, _signature_problem(spec, fn)


def _weight_problems(specs: list[str], weights: list[float] | None) -> list[str]:
    if weights is None:
        return []
    if len(weights) != len(specs):
        many = f"--reward_weights has {len(weights)} values for {len(specs)} --reward_funcs"
        return [f"{many}; give one weight per function, in the same order (or none: 1.0 each)"]
    bad = [(s, w) for s, w in zip(specs, weights, strict=True) if not _finite(w)]
    return [f"--reward_weights value {w!r} (for {s!r}) is not a finite number; give a finite number" for s, w in bad]


def _finite(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def reward_problems(specs: list[str], weights: list[float] | None) -> list[str]:
    """Every problem of --reward_funcs and --reward_weights, each one line naming the flag, the value and the fix.
    Imports the modules and files named (once; `load_reward_functions` reuses them) but calls no function."""
    if not specs:
        forms = _FORMS.format(builtins=builtin_names())
        return [f"--reward_funcs: no reward function given; --objective grpo needs one or more: {forms}"]
    out, specs = [], [s.strip() for s in specs]
    for i, spec in enumerate(specs):
        if spec in specs[:i]:
            out.append(f"--reward_funcs {spec!r} is given twice; name it once (weigh it with --reward_weights)")
        elif problem := _resolve(spec)[1]:
            out.append(problem)
    return out + _weight_problems(specs, weights)


def load_reward_functions(specs: list[str], weights: list[float] | None) -> list[RewardFunction]:
    """The functions `specs` name, with their weights (1.0 each without). Raises ValueError with the first problem
    of `reward_problems`."""
    if problems := reward_problems(specs, weights):
        raise ValueError(problems[0])
    weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
    return [RewardFunction(s.strip(), _resolve(s.strip())[0], w) for s, w in zip(specs, weights, strict=True)]


def _short(value, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class _Batch:
    """One call's arguments, and how a message names a completion's dataset row."""

    prompts: list
    completions: list
    completion_ids: list
    columns: dict[str, list]
    row_ids: list[int]

    def kwargs(self, rows: list[int] | None = None) -> dict:
        pick = (lambda v: v) if rows is None else (lambda v: [v[i] for i in rows])
        named = {"prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids}
        return {k: pick(v) for k, v in {**self.columns, **named}.items()}

    def where(self, i: int) -> str:
        prompt = " ".join(content_text(self.prompts[i]).split())
        excerpt = prompt if len(prompt) <= _EXCERPT else prompt[:_EXCERPT] + "..."
        return f"dataset row {self.row_ids[i]} (prompt {excerpt!r})"

    def rows(self) -> str:
        rows = sorted(set(self.row_ids))
        if len(rows) > 1 and rows[-1] - rows[0] == len(rows) - 1:
            return f"dataset rows {rows[0]}..{rows[-1]}"
        listed = ", ".join(map(str, rows if len(rows) <= 4 else [*rows[:3], "...", rows[-1]]))
        return f"dataset row{'s' * (len(rows) > 1)} {listed}"


async def _awaited(result):
    return await result


def _call(fn: Callable, kwargs: dict, extras: dict):
    result = fn(**{**kwargs, **extras})  # as TRL: trainer_state and the loggers override columns of those names
    return asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result


def _first_failure(f: RewardFunction, batch: _Batch, extras: dict):
    """(the first completion that raises alone, its exception), or (None, None)."""
    extras = {**extras, **_log_keywords(RewardLog())}  # what the re-runs log is not the batch's
    for i in range(len(batch.completions)):
        try:
            _call(f.fn, batch.kwargs([i]), extras)
        except Exception as e:  # noqa: BLE001 - the row's failure is the message
            return i, e
    return None, None


def _as_float(f: RewardFunction, value, batch: _Batch, i: int) -> float:
    fix = "return a finite number, or None where the function does not apply"
    if value is None:
        return math.nan
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        got = f"{_short(value, 60)} (a {type(value).__name__})"
        raise RewardError(f"reward function {f.name!r} returned {got} for {batch.where(i)}; {fix}")
    x = float(value)
    if not math.isfinite(x):
        raise RewardError(f"reward function {f.name!r} returned {x} for {batch.where(i)}; {fix}")
    return x


def _values(f: RewardFunction, result, batch: _Batch) -> list[float]:
    n = len(batch.completions)
    if hasattr(result, "tolist"):  # a tensor or an array
        result = result.tolist()
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
        got = f"{_short(result, 60)} (a {type(result).__name__})"
        raise RewardError(
            f"reward function {f.name!r} returned {got} on {batch.rows()}, not a list; return one reward per completion"
        )
    result = list(result)
    if len(result) != n:
        raise RewardError(
            f"reward function {f.name!r} returned {len(result)} rewards for {n} completions on {batch.rows()}; "
            "return one per completion, None where it does not apply"
        )
    return [_as_float(f, v, batch, i) for i, v in enumerate(result)]


def _log_keywords(log: RewardLog) -> dict:
    return {"log_extra": log.log_extra, "log_metric": log.log_metric}


def _score(f: RewardFunction, batch: _Batch, extras: dict, timeout_s: float | None) -> list[float]:
    """One function's rewards for the batch, or a RewardError naming the row and the fix."""
    try:
        result = bounded(timeout_s, _call, _LATE, f.fn, batch.kwargs(), extras)
    except Exception as e:
        # One deadline for the whole search; past it, the batch's exception without a row.
        i, row_error = bounded(timeout_s, _first_failure, (None, None), f, batch, extras)
        if i is None:
            raise RewardError(
                f"reward function {f.name!r} raised {_short(e)} on {batch.rows()}, though no row raises alone; "
                "fix the function"
            ) from e
        raise RewardError(
            f"reward function {f.name!r} raised {_short(row_error)} on {batch.where(i)}; fix the function or the row"
        ) from e
    if result is _LATE:
        raise RewardError(
            f"reward function {f.name!r} took longer than {timeout_s:g} s on {batch.rows()} (--reward_timeout); "
            "speed it up or raise the limit"
        )
    return _values(f, result, batch)


def compute_rewards(
    funcs: list[RewardFunction],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    row_ids: list[int],
    timeout_s: float | None,
    trainer_state=None,
    log: RewardLog | None = None,
) -> torch.Tensor:
    """[N, len(funcs)] float32 rewards, NaN where a function returned None. Each function is called once on the
    batch (the module's docstring says with what), within `timeout_s` (None or 0: no limit). `row_ids`: the dataset
    row of each completion, for messages. `trainer_state` and `log`: passed as TRL's trainer_state, and log_extra /
    log_metric's destination. Warns (TRL's warning) when every function returned None for some completion."""
    n = len(completions)
    lengths = {"prompts": prompts, "completion_ids": completion_ids, "row_ids": row_ids, **columns}
    if wrong := {k: len(v) for k, v in lengths.items() if len(v) != n}:
        raise ValueError(f"compute_rewards: {n} completions but these lengths: {wrong}")
    columns = {k: v for k, v in columns.items() if k not in ("prompt", "completion", "completion_ids")}  # TRL's
    batch = _Batch(prompts, completions, completion_ids, columns, row_ids)
    extras = {"trainer_state": trainer_state, **_log_keywords(log if log is not None else RewardLog())}
    out = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    for j, f in enumerate(funcs):
        out[:, j] = torch.tensor(_score(f, batch, extras, timeout_s), dtype=torch.float32)
    unscorable = torch.isnan(out).all(dim=1).nonzero().flatten().tolist() if funcs else []
    if unscorable:
        warn0(
            f"every reward function returned None for {len(unscorable)} of {n} completions (first: "
            f"{batch.where(unscorable[0])}): they get no reward and no advantage; make at least one function score "
            "every row"
        )
    return out


def combine_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N] total rewards, as TRL's GRPOTrainer: the weighted sum of each row's rewards leaving out NaN (a function
    that returned None), and NaN for a row whose every function returned None (TRL: "unscorable", left out of the
    group's baseline, its advantage set to 0)."""
    total = (rewards * weights.to(rewards.device, rewards.dtype).unsqueeze(0)).nansum(dim=1)
    total[torch.isnan(rewards).all(dim=1)] = math.nan
    return total
