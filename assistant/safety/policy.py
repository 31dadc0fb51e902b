"""Safety policies: named TOML files that choose categories, detectors, thresholds and actions.

A policy says, for each stage of a turn (`input`: the user's message; `retrieved` / `tool`: text
about to enter the model's context; `output`: the answer as it streams), which detectors run and
which categories count, and for each category the action and the score at which each detector acts:

    name = "default"
    [stages.input]
    detectors = ["prompt_guardrail", "profanity", "head"]       # cheapest first: a block stops early
    categories = ["prompt_injection", "toxicity", "weapons", "malware", "self_harm", "drugs"]
    [categories.weapons]
    action = "block"                                            # block | warn | log | allow
    thresholds = { head = 0.6 }
    [stages.input.second_opinion]                               # optional: a slower detector for the doubtful
    detector = "probe"                                          # it reads a text when `after`'s top score lies in
    after = "head"                                              # [band[0], band[1]); the mean of the two scores,
    band = [0.1, 0.95]                                          # against the category's `probe` threshold, then
                                                                # replaces `after`'s hits (see safety/guard.py)
    clears_below = 0.02                                         # optional: a text the second opinion scores under
                                                                # this is allowed whatever `after` says, so a turn
                                                                # that lends its prefill skips `after` (guard.py)
    [stages.retrieved]
    thresholds = { head = 0.8 }                                 # optional: this stage's own, over the category's
    [output]
    secret = "redact"                                           # redact | log | allow
    toxicity = "block"                                          # stop the answer with a notice

Actions: `block` refuses the message (or quarantines retrieved/tool text, or stops the answer);
`warn` lets it through with a SafetyVerdict event the user sees; `log` only writes the audit row;
`redact` replaces the span in the answer. Shipped policies live in assistant/safety/policies/
(`default`, `strict`, `permissive-research`); `safety.policies_dir` adds a folder of your own.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from assistant.errors import ConfigError

POLICY_DIR = Path(__file__).with_name("policies")
STAGES = ("input", "retrieved", "tool", "output")
INPUT_ACTIONS = ("block", "warn", "log", "allow")
OUTPUT_ACTIONS = ("redact", "block", "warn", "log", "allow")
ACTION_RANK = {"block": 3, "redact": 3, "warn": 2, "log": 1, "allow": 0}


@dataclass(frozen=True)
class CategoryRule:
    action: str = "block"  # block | warn | log | allow
    thresholds: dict[str, float] = field(default_factory=dict)  # detector name -> score at which it acts


@dataclass(frozen=True)
class SecondOpinion:
    detector: str  # the slower detector that reads what `after` leaves in doubt
    after: str  # the detector whose top score says whether a text is in doubt
    band: tuple[float, float]  # `after`'s top score in [low, high): in doubt
    clears_below: float = 0.0  # the second opinion's top score under which `after` has no say (0: never)


@dataclass(frozen=True)
class Stage:
    detectors: tuple[str, ...] = ()  # run in this order; a block stops the rest
    categories: tuple[str, ...] = ()  # categories that count at this stage
    thresholds: dict[str, float] = field(default_factory=dict)  # detector -> its threshold at this stage,
                                                                # over every category's (documents read unlike chat)
    second_opinion: SecondOpinion | None = None


@dataclass(frozen=True)
class Policy:
    name: str
    description: str = ""
    stages: dict[str, Stage] = field(default_factory=dict)
    categories: dict[str, CategoryRule] = field(default_factory=dict)
    output: dict[str, str] = field(default_factory=dict)  # output category -> redact | block | warn | log | allow

    def stage(self, where: str) -> Stage:
        return self.stages.get(where, Stage())

    def rule(self, category: str) -> CategoryRule:
        return self.categories.get(category, CategoryRule("allow"))

    def output_action(self, category: str) -> str:
        return self.output.get(category, "allow")

    @classmethod
    def from_toml(cls, path: Path) -> "Policy":
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"Cannot read safety policy {path}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"Safety policy {path} is not valid TOML: {e}") from e
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: dict, *, where: str = "policy") -> "Policy":
        unknown = set(raw) - {"name", "description", "stages", "categories", "output"}
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: name, description, stages, "
                              "categories, output).")
        stages = {}
        for name, s in raw.get("stages", {}).items():
            if name not in STAGES:
                raise ConfigError(f"{where}: unknown stage {name!r}; use {', '.join(STAGES)}.")
            thresholds = {d: float(t) for d, t in s.get("thresholds", {}).items()}
            if any(not 0.0 < t <= 1.0 for t in thresholds.values()):
                raise ConfigError(f"{where}: stages.{name}.thresholds must lie in (0, 1].")
            stages[name] = Stage(tuple(s.get("detectors", ())), tuple(s.get("categories", ())), thresholds,
                                 _second_opinion(s, f"{where}: stages.{name}"))
        categories = {}
        for name, c in raw.get("categories", {}).items():
            action = c.get("action", "block")
            if action not in INPUT_ACTIONS:
                raise ConfigError(f"{where}: categories.{name}.action={action!r}; use {', '.join(INPUT_ACTIONS)}.")
            thresholds = {d: float(t) for d, t in c.get("thresholds", {}).items()}
            if any(not 0.0 < t <= 1.0 for t in thresholds.values()):
                raise ConfigError(f"{where}: categories.{name}.thresholds must lie in (0, 1].")
            categories[name] = CategoryRule(action, thresholds)
        output = dict(raw.get("output", {}))
        for name, action in output.items():
            if action not in OUTPUT_ACTIONS:
                raise ConfigError(f"{where}: output.{name}={action!r}; use {', '.join(OUTPUT_ACTIONS)}.")
        if "name" not in raw:
            raise ConfigError(f"{where}: a policy needs a name.")
        for name, stage in stages.items():
            second = stage.second_opinion
            unjudged = [c for c in stage.categories if second is not None and c in categories
                        and second.after in categories[c].thresholds and second.detector not in categories[c].thresholds]
            if unjudged:
                raise ConfigError(f"{where}: stages.{name}.second_opinion asks {second.detector!r}, but categories "
                                  f"{', '.join(unjudged)} give it no threshold: add {second.detector} = 0.5 (for "
                                  "example) to their thresholds.")
        return cls(str(raw["name"]), str(raw.get("description", "")), stages, categories, output)


def _second_opinion(stage: dict, where: str) -> SecondOpinion | None:
    raw = stage.get("second_opinion")
    if raw is None:
        return None
    band = raw.get("band", ())
    numbers = isinstance(band, list) and len(band) == 2 and all(isinstance(b, (int, float)) for b in band)
    clears = raw.get("clears_below", 0.0)
    ok = (isinstance(raw.get("detector"), str) and raw.get("after") in stage.get("detectors", ())
          and numbers and 0.0 <= float(band[0]) < float(band[1]) <= 1.0
          and isinstance(clears, (int, float)) and not isinstance(clears, bool) and 0.0 <= clears < 1.0)
    if not ok:
        raise ConfigError(f"{where}.second_opinion needs detector = \"<name>\", after = one of the stage's detectors, "
                          "band = [low, high] with 0 <= low < high <= 1, and (optionally) clears_below in [0, 1).")
    return SecondOpinion(raw["detector"], raw["after"], (float(band[0]), float(band[1])), float(clears))


def available_policies(extra_dir: str | Path | None = None) -> dict[str, Path]:
    """Policy name -> file: the shipped ones, then (overriding) those in `extra_dir`."""
    found = {p.stem: p for p in sorted(POLICY_DIR.glob("*.toml"))}
    if extra_dir:
        found.update({p.stem: p for p in sorted(Path(extra_dir).expanduser().glob("*.toml"))})
    return found


def load_policy(name: str, extra_dir: str | Path | None = None) -> Policy:
    """A policy by name (or a path to a .toml file)."""
    if name.endswith(".toml"):
        return Policy.from_toml(Path(name))
    found = available_policies(extra_dir)
    if name not in found:
        raise ConfigError(f"Unknown safety policy {name!r}: use one of {', '.join(sorted(found))}, or the path "
                          "of a .toml policy file.")
    return Policy.from_toml(found[name])
