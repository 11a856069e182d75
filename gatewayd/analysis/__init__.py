"""AI session analysis: verdicts, the offline analyzer, provider clients and the service that applies rules."""

from gatewayd.analysis.offline import language_of, rate
from gatewayd.analysis.providers import PROVIDERS, AnalyzerError, classify
from gatewayd.analysis.service import (
    FAILURE_POLICIES,
    NATIVE_ASYNC,
    NATIVE_MODES,
    NATIVE_SYNC,
    AnalysisService,
    rule_for,
)
from gatewayd.analysis.verdict import ACTIONS, ALLOW, BLOCK, RISK_KEYS, RISK_LEVELS, Rating, Verdict

__all__ = ["ACTIONS", "ALLOW", "BLOCK", "FAILURE_POLICIES", "NATIVE_ASYNC", "NATIVE_MODES", "NATIVE_SYNC", "PROVIDERS",
           "RISK_KEYS", "RISK_LEVELS", "AnalysisService", "AnalyzerError", "Rating", "Verdict", "classify",
           "language_of", "rate", "rule_for"]
