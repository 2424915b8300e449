"""What ``Trainer.fit`` does when a step fails: the failure policy, in one place (after Ray Train's FailurePolicy).

    the error                                       decision
    the ranks still run (bad input, a driver bug)   RAISE it as it is: nothing was lost, nothing to restart
    ranks gone (died, hung: the group ended)        RESTART, up to max_failures times:
                                                      new rank actors, placed afresh (model.restart())
                                                      reload the newest complete state of the run, or the
                                                      initial weights when none was saved yet
                                                      data order, schedule and metrics put back at its step
                                                      record {"restart", "step", "failed_at_step",
                                                      "resumed_from", "cause", "time_lost_s"} in metrics.jsonl
    ranks gone once more than max_failures allows   RAISE TrainingFailed, naming the newest state

``cause`` is the error's first line; for a rank failure that line names the rank(s) where it began
(:class:`actors.RankError`), never a survivor whose collective lost its peer.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from raymoe.checkpoint.storage import Location


class TrainingFailed(RuntimeError):
    """``fit()`` gave up: ranks failed once more than ``max_failures`` allows; ``state`` is the newest state (None:
    none was saved), which a ``resume_from="latest"`` run continues from; ``cause`` the last failure's first line."""

    def __init__(self, message: str, state: Location | None, cause: str = "") -> None:
        super().__init__(message)
        self.state = state
        self.cause = cause


class Decision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


@dataclass(frozen=True)
class FailurePolicy:
    """``max_failures`` restarts of the ranks per ``fit`` at most (0: the first failure is raised)."""

    max_failures: int

    def decide(self, ranks_alive: bool, restarts: int) -> Decision:
        """RESTART only when the failure ended the ranks and restarts are left (see the module docstring)."""
        if ranks_alive or restarts >= self.max_failures:
            return Decision.RAISE
        return Decision.RESTART

    def give_up(self, error: Exception, ranks_alive: bool, restarts: int, newest_state: Location | None) -> Exception:
        """What ``fit`` raises: the error itself, or :class:`TrainingFailed` once restarts were allowed."""
        if self.max_failures == 0 or ranks_alive:
            return error
        where = (
            f"{newest_state}: resume from it with resume_from='latest'"
            if newest_state is not None
            else "none (no state saved)"
        )
        return TrainingFailed(
            f"training failed again after {restarts} restart(s) (max_failures={self.max_failures}): "
            f"{cause_of(error)}. The newest training state is {where}",
            newest_state,
            cause_of(error),
        )


def cause_of(error: BaseException) -> str:
    """``Type: first line``: for a rank failure, the line naming the rank(s) where it began."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@dataclass
class RestartRecord:
    """The metrics record of one restart, written once the first step after it finished (``time_lost_s`` runs from
    the failure to then)."""

    restart: int
    step: int  # the step the run went on from
    failed_at_step: int
    resumed_from: Location | None
    cause: str
    failed_at: float = field(default_factory=time.monotonic)

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "restart": self.restart,
            "failed_at_step": self.failed_at_step,
            "resumed_from": str(self.resumed_from) if self.resumed_from is not None else None,
            "cause": self.cause,
            "time_lost_s": time.monotonic() - self.failed_at,
        }
