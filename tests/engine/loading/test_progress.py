"""A load reports its phases (read, convert with a count, cached, compile) for the CLI's
progress bars and ``/v1/models`` ``loading``; nothing is left once it ends."""

from __future__ import annotations

import threading

from gmlx.engine.loading import progress
from gmlx.engine.loading.progress import LoadStatus


def test_phases_reach_listeners_and_end_with_the_load() -> None:
    seen: list[tuple[str, LoadStatus]] = []
    with progress.listening(lambda m, s: seen.append((m, s))):
        with progress.loading("m"):
            progress.phase("read")
            progress.phase("convert", total=3)
            for _ in range(3):
                progress.advance()
            assert progress.status("m") == LoadStatus("convert", 3, 3)
        assert progress.status("m") is None
        progress.phase("read")  # outside a load: nobody's, nothing reported
    assert [s for _, s in seen] == [LoadStatus("read"), LoadStatus("convert", 0, 3),
                                    LoadStatus("convert", 1, 3), LoadStatus("convert", 2, 3),
                                    LoadStatus("convert", 3, 3)]
    assert {m for m, _ in seen} == {"m"}


def test_loads_on_two_threads_report_apart() -> None:
    started, release = threading.Barrier(3), threading.Event()

    def load(model_id: str, total: int) -> None:
        with progress.loading(model_id):
            progress.phase("convert", total=total)
            progress.advance()
            started.wait(5)
            release.wait(5)

    threads = [threading.Thread(target=load, args=(m, t)) for m, t in (("a", 5), ("b", 7))]
    for t in threads:
        t.start()
    started.wait(5)
    assert progress.status("a") == LoadStatus("convert", 1, 5)
    assert progress.status("b") == LoadStatus("convert", 1, 7)
    release.set()
    for t in threads:
        t.join(5)
    assert progress.status("a") is None and progress.status("b") is None


def test_a_gguf_load_counts_its_tensors_then_reads_them_back(tiny_models, monkeypatch, tmp_path) -> None:
    from gmlx.engine.loading import load_model

    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path))  # a cold converted-weights cache
    tiny = tiny_models["llama-Q4_0"]
    phases: list[LoadStatus] = []
    with progress.listening(lambda m, s: phases.append(s)):
        with progress.loading("tiny"):
            load_model(tiny.path)
        cold = list(phases)
        phases.clear()
        with progress.loading("tiny"):
            load_model(tiny.path)
    converts = [s for s in cold if s.phase == "convert"]
    assert cold[0].phase == "read" and converts[-1].done == converts[-1].total > 0
    assert [s.phase for s in phases] == ["read", "cached"]


def test_the_listing_shows_a_loading_model_with_its_phase() -> None:
    from gmlx.engine.addressing import ModelSpec
    from gmlx.engine.residency import Registry

    registry = Registry([ModelSpec("m", "demo")])
    try:
        with progress.loading("m"):
            progress.phase("convert", total=10)
            progress.advance(4)
            (row,) = registry.listing()
            assert not row.resident and row.loading == {"phase": "convert", "done": 4, "total": 10}
        (row,) = registry.listing()
        assert row.loading is None
    finally:
        registry.close()


def test_the_server_console_prints_a_line_per_phase_and_a_bar_per_tenth(capsys) -> None:
    from gmlx.cli.serve import _print_progress

    _print_progress("m", LoadStatus("read"))
    for done in range(21):
        _print_progress("m", LoadStatus("convert", done, 20))
    err = capsys.readouterr().err
    assert "loading m: reading" in err
    lines = [line for line in err.splitlines() if "converting tensors" in line]
    assert len(lines) == 11 and lines[-1].endswith("20/20") and "█" * 20 in lines[-1]


def test_the_cli_bar_follows_the_phases_on_a_terminal_only(monkeypatch) -> None:
    import io

    from rich.console import Console

    from gmlx.cli import local

    out = io.StringIO()
    monkeypatch.setattr(local, "err_console", Console(file=out, force_terminal=True, width=100))
    with local.load_progress("model.gguf") as show:
        show("m", LoadStatus("read"))
        show("m", LoadStatus("convert", 5, 10))
        local.err_console.print("")  # let the live display draw once more
    assert "Loading model.gguf: converting tensors" in out.getvalue() and "5/10" in out.getvalue()
    piped = io.StringIO()
    monkeypatch.setattr(local, "err_console", Console(file=piped, force_terminal=False))
    with local.load_progress("model.gguf") as show:
        show("m", LoadStatus("convert", 5, 10))
    assert piped.getvalue() == ""
