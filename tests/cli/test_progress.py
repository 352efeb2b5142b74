"""Progress on stderr (tierkv.cli.progress): plain lines when stderr is not a
terminal, one per phase or every few seconds."""

from __future__ import annotations


def test_progress_writes_a_line_per_phase_or_every_few_seconds() -> None:
    import io

    from tierkv.cli.progress import Progress as _Progress

    out = io.StringIO()
    with _Progress(True, None, "starting", command="bench", every=3600, stream=out) as p:
        p.update("cpu: repetition 1/3, tierkv")
        p.update("cpu: repetition 1/3, raw")  # same phase, too soon: no line
        p.update("nvme: repetition 1/3, tierkv")
    text = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in text] == [
        "starting",
        "cpu: repetition 1/3, tierkv",
        "nvme: repetition 1/3, tierkv",
    ]
    out = io.StringIO()
    with _Progress(True, None, "starting", command="bench", every=0, stream=out) as p:
        p.update("cpu: repetition 1/3, tierkv")
        p.update("cpu: repetition 1/3, raw")  # `every` passed: a line
    assert len(out.getvalue().splitlines()) == 3
