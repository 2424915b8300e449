"""Ctrl-C (SIGINT) and SIGTERM while ``Trainer.fit`` runs: stop at the next step boundary, never mid-step.

    first signal    noted; the step in progress finishes, the training state is saved there
                    (save_state_on_interrupt) and fit raises TrainingInterrupted (step, state)
    second signal   KeyboardInterrupt at once (the handle's ``with`` block then frees the ranks)

Only in the main thread, where Python delivers signals; elsewhere fit runs without handlers.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from raymoe.checkpoint.storage import Location

logger = logging.getLogger(__name__)


class TrainingInterrupted(KeyboardInterrupt):
    """``fit()`` stopped at a step boundary after SIGINT / SIGTERM; ``step`` and ``state`` (None: none saved) say
    where it stopped and what a ``resume_from`` run continues from."""

    def __init__(self, message: str, step: int, state: Location | None) -> None:
        super().__init__(message)
        self.step = step
        self.state = state


class StopRequests:
    """The first SIGINT / SIGTERM during :meth:`listening` (its name in ``signal``); ``step`` says where the run is."""

    def __init__(self, step: Callable[[], int], saving: bool) -> None:
        self.signal: str | None = None
        self._step, self._saving = step, saving

    @contextmanager
    def listening(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.getsignal(sig) for sig in signals}
        for sig in signals:
            signal.signal(sig, self._request)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.signal = None

    def _request(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        step = self._step() + 1
        if self.signal is not None:
            raise KeyboardInterrupt(f"{name} again: stopped at once, in step {step}")
        self.signal = name
        saving = " and saving the training state" if self._saving else ""
        logger.warning("%s: stopping after step %d%s (%s again stops at once)", name, step, saving, name)
