"""Makes ``pytest conformance --target=NAME`` work in a checkout where the suite is not installed.

Installed (``pip install lora-conformance``, or ``pip install -e .`` in a checkout), pytest loads the
plugin ``conformance.plugin`` through its ``pytest11`` entry point in every run; registering its hooks
here as well would add every option twice. So this conftest registers them only when pytest will not:
the package is not installed, or plugin autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``).
"""

import os
from importlib.metadata import entry_points

PLUGIN = "conformance.plugin"

if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") or not any(ep.value == PLUGIN for ep in entry_points(group="pytest11")):
    from conformance.plugin import *  # noqa: F403 - pytest finds hooks and fixtures by name (the plugin's __all__)
