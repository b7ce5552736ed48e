"""The whole suite: the unit tests first (the quickest answer), then the integration tests;
the process-boundary runs registered in tests/early.py start with the session, beside the unit
tests, which leave a core idle. The tests that collect a run of the integration lane (started
with the first integration test, tests/early.py's LANE) come last, in the lane's order: the
in-process tests keep a core busy meanwhile, where a test waiting for its run in the middle held
both lanes to one core (the resume tests waited 3 minutes so)."""
from pathlib import Path

from tests import early


def pytest_collection_modifyitems(items):
    # the modules are imported: their runs are registered
    lane = {module: i for i, module in enumerate(early.lane_modules())}
    items.sort(key=lambda item: ("integration" in Path(item.path).parts,  # stable
                                 lane.get(Path(item.path).resolve(), -1)))


def pytest_collection_finish(session):
    if not session.config.option.collectonly:
        early.SELECTED.update(Path(item.path).resolve() for item in session.items)
        early.start_selected()


def pytest_sessionfinish():
    early.remove_all()
