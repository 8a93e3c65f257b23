"""The accelerator machine's calls name only servers its bench knows: a lease is a few
device minutes, and a call refused for an unknown server name (the 12-06 variants were
named by lease.sh before bench.py listed them) loses one of them. Reads the scripts'
text; runs nothing."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.gpu import bench

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


def test_every_server_a_call_names_is_one_bench_runs() -> None:
    named = set()
    for script in (GPU / "lease.sh", GPU / "diagnose.sh"):  # (the README also tells of past variants)
        for servers in re.findall(r"--servers[ =]([\w,.-]+)", script.read_text()):
            named.update(s for s in servers.split(",") if s)
    assert {"gmlx", "llama", "gmlx-all1206", "gmlx-fold"} <= named  # the calls were read
    assert named <= set(bench.SERVERS), sorted(named - set(bench.SERVERS))
    assert set(bench.GMLX_VARIANTS) <= set(bench.SERVERS)
