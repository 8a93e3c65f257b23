"""The accelerator machine's calls name only servers its bench knows: a lease is a few
device minutes, and a call refused for an unknown server name (the 12-06 variants were
named by lease.sh before bench.py listed them) loses one of them. Reads the scripts'
text; runs nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.gpu import bench, kernel_times, step_variants

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


def test_every_server_a_call_names_is_one_bench_runs() -> None:
    named = set()
    for script in (GPU / "lease.sh", GPU / "diagnose.sh"):  # (the README also tells of past variants)
        # a --servers list, or one a call sets in a variable first (servers=a,b; --servers "$servers")
        for servers in re.findall(r"(?:--servers[ =]|\bservers=)([\w,.-]+)", script.read_text()):
            named.update(s for s in servers.split(",") if s)
    assert {"gmlx", "llama", "gmlx-all1206", "gmlx-fold", "gmlx-splitk", "mlx_lm-gmlxenv"} <= named  # the calls were read
    assert named <= set(bench.SERVERS), sorted(named - set(bench.SERVERS))
    assert set(bench.GMLX_VARIANTS) <= set(bench.SERVERS)


def test_every_variant_a_step_comparison_names_is_one_bench_knows() -> None:
    named = set()
    calls = [line for line in (GPU / "lease.sh").read_text().splitlines() if "step_variants.py" in line or "VARIANTS=" in line]
    for variants in re.findall(r'(?:--variants[ =]"?(?:\$\{VARIANTS:-)?|VARIANTS=)([\w,.-]+)', "\n".join(calls)):
        named.update(v for v in variants.split(",") if v)
    assert {"gmlx", "gmlx-nofold", "gmlx-qkv"} <= named  # the default call and the candidates' call both read
    assert named <= {"gmlx", *bench.GMLX_VARIANTS}, sorted(named - {"gmlx", *bench.GMLX_VARIANTS})


def test_step_variants_reads_what_kernel_times_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The comparison's rows come from kernel_times' own report (its tracer's summary,
    fed two windows of kernels: no PyTorch here) and its wall lines, and its summary
    divides each variant's medians by the defaults'."""
    tracer = kernel_times._Tracer.__new__(kernel_times._Tracer)  # (its __init__ imports PyTorch)
    # window 0: two steps of two kernels each, 1 us apart; window 1: overlapping kernels
    tracer.windows = {0: [("qgemv", 0.0, 10.0), ("attend", 11.0, 21.0), ("qgemv", 22.0, 32.0), ("attend", 33.0, 43.0)],
                      1: [("qgemv", 0.0, 10.0), ("qmv", 5.0, 15.0), ("qgemv", 20.0, 30.0), ("qmv", 25.0, 35.0)]}
    tracer.report(steps=2, top=4)
    report = capsys.readouterr().out
    output = ("window 0 width 1 loop served: 4.26 ms a step\nwindow 1 width 8 loop served: 5.10 ms a step\n"
              + report)
    rows = step_variants.parse(output)
    assert set(rows) == {1, 8}  # per width
    assert rows[1] == (4.26, 0.02, 0.02, 0.02, 2.0)  # span 43 us / 2 steps, busy 40 / 2, kernels 40 / 2
    assert rows[8] == (5.10, 0.02, 0.01, 0.02, 2.0)  # busy 30 of 40 summed: the overlap counted once
    summary = "\n".join(step_variants.summary({"gmlx": {1: [(4.0, 3.8, 3.6, 4.3, 424), (4.4, 4.0, 3.6, 4.3, 424)]},
                                               "gmlx-qkv": {1: [(4.2, 3.8, 3.5, 3.8, 376)]}}))
    assert "| 1 | gmlx | 2 | 4.20 | 3.90 | 3.60 | 4.30 | 424 | 1.000 | 1.000 |" in summary
    assert "| 1 | gmlx-qkv | 1 | 4.20 | 3.80 | 3.50 | 3.80 | 376 | 1.000 | 0.972 |" in summary
    with pytest.raises(SystemExit, match="no variant 'gmlx-nonesuch'"):
        step_variants.environment("gmlx-nonesuch")
    assert step_variants.environment("gmlx-qkv") == {"GMLX_QKV_KERNEL": "1"}
