"""Bars on a terminal, plain lines elsewhere."""
import io

from rl.observe.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_gets_a_bar_with_the_postfix_and_every_line():
    out = Terminal()
    bar = Progress(3, "RL steps", stream=out)
    for step in (1, 2, 3):
        bar.update(step, f"step {step}/3 | detail", {"reward": f"{0.1 * step:.3f}"})
    bar.close()
    text = out.getvalue()
    assert "RL steps" in text and "3/3" in text and "reward=0.300" in text
    assert all(f"step {s}/3 | detail" in text for s in (1, 2, 3))


def test_a_pipe_gets_plain_lines_every_nth_and_the_last():
    out = io.StringIO()
    bar = Progress(7, "warm-up", stream=out, every=3)
    for step in range(1, 8):
        bar.update(step, f"warm-up step {step}/7", {"loss": "1"})
    bar.close()
    assert out.getvalue().splitlines() == ["warm-up step 3/7", "warm-up step 6/7",
                                           "warm-up step 7/7"]
