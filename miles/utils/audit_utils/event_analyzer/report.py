"""What the analyzer reports: one ``Finding`` per broken invariant, in an ``AnalysisReport``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, NonNegativeInt


class Finding(BaseModel):
    """One violation of a rule, with the events that show it (oldest first)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str
    message: str
    model_name: str
    server_id: str | None = None
    step: int | None = None
    weight_version: str | None = None
    event_ids: tuple[str, ...]


class AnalysisReport(BaseModel):
    """The findings of every rule run over ``events_checked`` events; ``passed`` when none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    findings: tuple[Finding, ...]
    events_checked: NonNegativeInt

    @property
    def passed(self) -> bool:
        """True when no rule found anything."""
        return not self.findings
