"""What an analysis says: a rating (risk level, title, explanation) and, through a rule, an action."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOW, MEDIUM, HIGH = "low", "medium", "high"
RISK_LEVELS = (LOW, MEDIUM, HIGH)
ALLOW, BLOCK = "allow_execution", "block_execution"
ACTIONS = (ALLOW, BLOCK)
RISK_KEYS = {LOW: "low_risk_action", MEDIUM: "medium_risk_action", HIGH: "high_risk_action"}
DEFAULT_RISK_EVALUATION = {"low_risk_action": ALLOW, "medium_risk_action": ALLOW, "high_risk_action": BLOCK}
TITLE_WORDS = 4
EXPLANATION_WORDS = 30


def clip_words(text: str, limit: int) -> str:
    """``text`` on one line, cut to ``limit`` words."""
    words = str(text).split()
    return " ".join(words[:limit])


def severity(level: str) -> int:
    return RISK_LEVELS.index(level)


@dataclass(slots=True, frozen=True)
class Rating:
    """An analyzer's judgement of a script or statement: how risky, in four words and in thirty."""

    risk_level: str
    title: str
    explanation: str
    analyzer: str = "offline"

    def __post_init__(self) -> None:
        if self.risk_level not in RISK_LEVELS:
            raise ValueError(f"risk_level must be one of {', '.join(RISK_LEVELS)}, got {self.risk_level!r}")
        object.__setattr__(self, "title", clip_words(self.title, TITLE_WORDS))
        object.__setattr__(self, "explanation", clip_words(self.explanation, EXPLANATION_WORDS))


def higher(first: Rating, second: Rating) -> Rating:
    """The riskier of two ratings; ``first`` on a tie."""
    return second if severity(second.risk_level) > severity(first.risk_level) else first


@dataclass(slots=True, frozen=True)
class Verdict:
    """A rating with the action its rule gives it: the session's ``ai_analysis``."""

    action: str
    risk_level: str
    title: str
    explanation: str
    analyzer: str = "offline"
    rule: str = ""

    @property
    def blocked(self) -> bool:
        return self.action == BLOCK

    def as_json(self) -> dict[str, Any]:
        """The specification's AI analysis object."""
        return {"action": self.action, "explanation": self.explanation, "risk_level": self.risk_level,
                "title": self.title}

    def message(self) -> str:
        """The line a blocked script shows and its recording keeps."""
        return (f"blocked by AI session analysis (rule {self.rule!r}): {self.risk_level} risk, "
                f"{self.title}: {self.explanation}")


def action_for(risk_evaluation: dict[str, str], risk_level: str) -> str:
    """The action a rule's ``risk_evaluation`` gives a risk level (missing keys: the defaults)."""
    key = RISK_KEYS[risk_level]
    return risk_evaluation.get(key) or DEFAULT_RISK_EVALUATION[key]


def verdict_for(rating: Rating, risk_evaluation: dict[str, str], rule: str) -> Verdict:
    return Verdict(action_for(risk_evaluation, rating.risk_level), rating.risk_level, rating.title,
                   rating.explanation, rating.analyzer, rule)
