"""Progress shows on a terminal only, and never with --quiet or --json: scripted runs see nothing but output."""

from __future__ import annotations

import io

import pytest

from autoshard.cli import build_parser
from autoshard.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_shows_the_current_step_and_clears_it():
    term = _Terminal()
    with Progress(stream=term) as progress:
        progress("searching 12 configurations")
        progress("searched 3 configurations (5/12 by bound)")
        bar = progress.steps("measuring steps")
        for done in range(1, 4):
            bar(done, 3)
    shown = term.getvalue()
    assert "autoshard: searched 3 configurations (5/12 by bound)" in shown  # the latest step replaces the last
    assert "autoshard: measuring steps" in shown and "3/3" in shown
    assert shown.endswith("\x1b[2K")  # transient: the line is erased when the command ends


@pytest.mark.parametrize("enabled, stream", [(True, io.StringIO()), (False, _Terminal())])
def test_progress_off_a_terminal_or_when_disabled_writes_nothing(enabled, stream):
    progress = Progress(enabled, stream=stream)
    progress("capturing gpt2")
    assert progress.steps("measuring steps") is None
    progress.close()
    assert not progress.enabled and stream.getvalue() == ""


@pytest.mark.parametrize("command", [["plan", "gpt2", "--cluster", "1x8xA100-80GB"],
                                     ["estimate", "gpt2", "--cluster", "1x8xA100-80GB", "--global-batch", "8"],
                                     ["inspect", "gpt2"], ["measure", "plan.json"], ["profile", "-o", "c.yaml"]])
def test_every_long_running_command_takes_quiet(command):
    assert build_parser().parse_args([*command, "--quiet"]).quiet is True
