"""``uv pip install ARGS`` into this interpreter's environment, from the package sources pip is configured with.

``make install`` installs with uv (a pinned wheel from the registry) rather than pip: the same packages at the same
versions, in ~8 s instead of ~62 s on 2 cores (pip fetches and unpacks one wheel at a time, uv in parallel). uv
reads none of pip's configuration (pip.conf files, ``PIP_*`` variables), so the settings that say where packages
come from and which are allowed are read from ``pip config list`` and handed on, pip's precedence kept (a variable
over the ``install`` section over ``global``):

    index-url, extra-index-url, find-links, no-index, constraint  ->  uv's options of those names
    trusted-host                                                  ->  --allow-insecure-host
    cert                                                          ->  SSL_CERT_FILE
    (any other setting: uv has no equivalent that decides what gets installed; it is left out)

``--index-strategy unsafe-best-match`` is pip's rule: every index is asked and the best version wins (uv's default
takes the first index that has the package at all). Files are copied from uv's cache, as pip leaves them: no hard
links into a cache the user may clean.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SECTIONS = {"global": 0, "install": 1, ":env:": 2}  # pip's precedence, lowest first
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "trusted-host": "--allow-insecure-host",
    "constraint": "--constraint",
}


def pip_settings(listing: str) -> dict[str, str]:
    """``pip config list``'s lines (``section.key='value'``) as key -> value, the highest-precedence section winning."""
    settings: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, _, quoted = line.partition("=")
        section, _, key = name.rpartition(".")
        if section not in SECTIONS or not quoted:
            continue
        value = ast.literal_eval(quoted)  # the listing writes each value as Python's repr
        if key not in settings or SECTIONS[section] >= settings[key][0]:
            settings[key] = (SECTIONS[section], value)
    return {key: value for key, (_, value) in settings.items()}


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """pip's settings as uv's command-line options and environment variables."""
    options: list[str] = []
    for key, flag in OPTIONS.items():
        for value in settings.get(key, "").split():
            options += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    env = {"SSL_CERT_FILE": settings["cert"]} if "cert" in settings else {}
    return options, env


def main(args: list[str]) -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    options, env = uv_options(pip_settings(listing))
    uv = Path(sys.executable).with_name("uv")
    command = [str(uv), "pip", "install", "--python", sys.executable, "--index-strategy", "unsafe-best-match"]
    command += ["--link-mode", "copy", *options, *args]
    return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
