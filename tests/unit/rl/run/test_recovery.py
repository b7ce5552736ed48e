"""The one line a dead actor gets: its cause, from Ray's error text."""
from rl.errors import death_cause, last_line


class Died(Exception):
    pass


def test_death_cause_names_oom_and_signals():
    oom = Died("The actor died because its worker was killed by the memory monitor: "
               "Task was killed due to the node running low on memory (OutOfMemoryError)")
    assert death_cause(oom).startswith("out of memory")
    killed = Died("The actor is dead because its worker process has died.\n"
                  "Worker exit type: SYSTEM_ERROR Worker exit detail: the process was killed "
                  "by SIGKILL")
    assert "SIGKILL" in death_cause(killed)
    assert death_cause(Died("")) == "Died"


def test_last_line_is_the_original_error_or_the_type():
    assert last_line(Died("ray::Scorer.__init__() failed\n  trace\nOSError: no such file\n")) \
        == "OSError: no such file"
    assert last_line(Died("")) == "Died"
