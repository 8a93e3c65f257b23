"""``tunings.py`` carries the load-time tuner's file between leases: kept under its card's
name, taken only on the machine (MLX, architecture, card) and format it was made for, and
never over a tuning the machine has already. Real files, this machine's own ``machine()``."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu import tunings
from gmlx.engine.kernels.tuning import FORMAT, machine


def _tuning(home: Path, who: str, entries: dict, form: int = FORMAT) -> Path:
    path = home / "cache" / "kernels" / "tuning.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": form, "machine": who, "entries": entries}))
    return path


def test_kept_then_taken_on_the_same_machine(tmp_path: Path) -> None:
    made = _tuning(tmp_path / "lease1", machine(), {"k": {"1": ["gemv", [4, 2]]}})
    said = tunings.keep(tmp_path / "lease1", tmp_path / "kept")
    kept = tmp_path / "kept" / tunings.slug(machine())
    assert kept.read_text() == made.read_text() and "1 entries" in said
    assert "took" in tunings.take(tmp_path / "lease2", tmp_path / "kept")
    assert (tmp_path / "lease2" / "cache" / "kernels" / "tuning.json").read_text() == made.read_text()


def test_another_cards_or_formats_tuning_is_not_taken(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "other.json").write_text(json.dumps({"format": FORMAT, "machine": machine() + "-other card",
                                                 "entries": {"k": {}}}))
    (kept / "old.json").write_text(json.dumps({"format": FORMAT - 1, "machine": machine(), "entries": {"k": {}}}))
    (kept / "broken.json").write_text("{not json")
    assert "the first load tunes" in tunings.take(tmp_path / "home", kept)
    assert not (tmp_path / "home" / "cache" / "kernels" / "tuning.json").exists()


def test_a_machines_own_tuning_is_never_overwritten(tmp_path: Path) -> None:
    own = _tuning(tmp_path / "home", machine(), {"mine": {}})
    _tuning(tmp_path / "lease", machine(), {"theirs": {}})
    tunings.keep(tmp_path / "lease", tmp_path / "kept")
    assert "already" in tunings.take(tmp_path / "home", tmp_path / "kept")
    assert json.loads(own.read_text())["entries"] == {"mine": {}}


def test_nothing_to_keep_says_so(tmp_path: Path) -> None:
    assert "no tuning" in tunings.keep(tmp_path / "empty", tmp_path / "kept")
    assert not (tmp_path / "kept").exists()
