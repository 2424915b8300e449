"""tools/uv_install.py: pip's package sources, as ``pip config list`` prints them, become uv's options."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parents[1] / "tools" / "uv_install.py"


def _tool():
    spec = importlib.util.spec_from_file_location("uv_install", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/older-wheels'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
global.trusted-host="mirror.example"
user.find-links='/not/a/section/pip/reads'
"""


def test_the_highest_precedence_setting_wins_and_values_are_unquoted():
    settings = _tool().pip_settings(LISTING)
    assert settings["find-links"] == "/opt/wheels"  # a PIP_ variable over pip.conf's global section
    assert settings["index-url"] == "https://install.example/simple"  # the install section over global
    assert settings["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    assert settings["trusted-host"] == "mirror.example"
    assert settings["default-timeout"] == "180"  # read, though uv is not given it


def test_each_source_becomes_a_uv_option_and_the_bundle_its_variable():
    tool = _tool()
    options, env = tool.uv_options(tool.pip_settings(LISTING))
    assert options == [
        "--index-url", "https://install.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--allow-insecure-host", "mirror.example",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]  # fmt: skip
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    assert tool.uv_options(tool.pip_settings(":env:.no-index='true'\n"))[0] == ["--no-index"]
    assert tool.uv_options({}) == ([], {})


def test_this_machines_pip_configuration_reads():
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    tool = _tool()
    settings = tool.pip_settings(listing)
    names = [line.partition("=")[0].rpartition(".") for line in listing.splitlines()]
    assert set(settings) == {key for section, _, key in names if section in tool.SECTIONS}  # every one pip applies
    assert all(isinstance(value, str) for value in settings.values())
