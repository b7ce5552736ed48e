"""The whole suite: the unit tests first (the quickest answer), then the integration tests;
the process-boundary runs registered in tests/early.py start with the session, beside the unit
tests, which leave a core idle."""
from pathlib import Path

from tests import early


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: "integration" in Path(item.path).parts)  # stable


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        early.SELECTED.update(Path(item.path).resolve() for item in session.items)
        early.start_selected()


def pytest_sessionfinish():
    early.remove_all()
