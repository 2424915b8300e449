"""Which experiment trackers ``TrainerConfig.report_to`` may name, the library and extra each needs, and the check.

    report_to="none" (default)       no tracker
    report_to="all"                  every tracker whose library is installed
    report_to="mlflow" / ["tensorboard", "wandb"]   those (a missing library: an error naming its extra)

Nothing here imports a tracker's library: :func:`importlib.util.find_spec` says whether it is installed.
"""

from __future__ import annotations

import importlib.util

# name -> the top-level module it needs (TensorBoard: torch.utils.tensorboard writes with the tensorboard package)
LIBRARIES: dict[str, str] = {
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "trackio": "trackio",
}
TRACKERS: tuple[str, ...] = tuple(LIBRARIES)
NONE, ALL = "none", "all"


class TrackerNotInstalled(ImportError, ValueError):
    """A tracker ``report_to`` names whose library is missing: an ``ImportError``, and a ``ValueError`` like every other
    bad ``TrainerConfig`` value (a script that reports bad input in one line catches it too)."""


def installed(name: str) -> bool:
    """Whether the library of tracker ``name`` can be imported (it is not imported here)."""
    try:
        return importlib.util.find_spec(LIBRARIES[name]) is not None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return False


def resolve_report_to(value: object) -> tuple[str, ...]:
    """``report_to`` as the tuple of tracker names it means, each once, in the order given.

    A str or a sequence of str; ``"none"`` (alone) is no tracker, ``"all"`` every installed one. Anything else is
    one ``ValueError`` naming the field, the value and the allowed names; a named tracker whose library is missing
    is a :class:`TrackerNotInstalled` naming the extra that installs it."""
    allowed = (*TRACKERS, ALL, NONE)
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, list | tuple) and all(isinstance(name, str) for name in value):
        names = list(value)
    else:
        raise ValueError(
            f"TrainerConfig: report_to={value!r} must be a str or a list of str, each one of {', '.join(allowed)}"
        )
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(
            f"TrainerConfig: report_to={value!r} names unknown tracker(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(allowed)}"
        )
    if (NONE in names or ALL in names) and len(names) > 1:
        raise ValueError(f"TrainerConfig: report_to={value!r}: {NONE!r} and {ALL!r} stand alone")
    if names == [ALL]:
        return tuple(name for name in TRACKERS if installed(name))
    chosen = tuple(dict.fromkeys(name for name in names if name != NONE))
    for name in chosen:
        if not installed(name):
            raise TrackerNotInstalled(
                f"TrainerConfig: report_to names {name!r}, but its library ({LIBRARIES[name]}) is not installed: "
                f"pip install 'raymoe[{name}]'",
                name=LIBRARIES[name],
            )
    return chosen
