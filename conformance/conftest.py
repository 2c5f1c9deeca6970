"""Makes ``pytest conformance --target=NAME`` work: the hooks live in ``conformance.plugin``."""

from conformance.plugin import (  # noqa: F401 - pytest finds hooks and fixtures by name
    conformance_run,
    pytest_addoption,
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
