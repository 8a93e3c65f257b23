"""``gmlx plan``: do WIDTH streams of DEPTH tokens each fit, and may they start now?

Without MODEL it asks a running server (``GET /v1/capacity/plan``, which also says
whether the fan-out may start now). With MODEL and no ``--url`` it loads the model
here and reads its capacity table against this machine's free memory; ``--kv-bits``
adds the plan with the model's KV quantized to that width, beside the plan as
configured. Exit code 0 when the streams fit (as configured), 1 when they do not or
the server has no table to judge by.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from gmlx.cli.client import DEFAULT_URL, call_server
from gmlx.cli.errors import fail
from gmlx.cli.estimate import OptionalModelArg, ServerUrlOpt, render_table
from gmlx.cli.local import load_here
from gmlx.cli.options import ApiKeyOpt, JsonOpt
from gmlx.engine.kv_quant import BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES

if TYPE_CHECKING:
    from gmlx.config import KVQuantConfig

EXIT_CODES = (
    "Exit codes: 0 the streams fit; 1 they do not fit, cannot be judged, or the plan failed "
    "(one sentence on stderr); 2 usage error."
)

WidthOpt = Annotated[int, typer.Option("--width", "-w", min=1, help="Streams that run together.")]
DepthOpt = Annotated[int, typer.Option("--depth", "-d", min=1, help="Tokens each stream reaches.")]
KVBitsOpt = Annotated[int | None, typer.Option(
    "--kv-bits", help=f"Quantize the KV cache's keys and values to this many bits ({', '.join(map(str, BITS))}).")]
KVGroupOpt = Annotated[int, typer.Option(
    "--kv-group-size", help=f"Values sharing a scale and a bias under --kv-bits ({', '.join(map(str, GROUP_SIZES))}).")]


def kv_quant_config(bits: int | None, group_size: int = DEFAULT_GROUP_SIZE) -> KVQuantConfig | None:
    """``--kv-bits`` and ``--kv-group-size`` as a uniform ``kv_quant`` (None without
    ``--kv-bits``); a width or group MLX cannot pack fails with one sentence."""
    if bits is None:
        return None
    if bits not in BITS:
        fail(f"--kv-bits {bits} cannot be packed: use one of {', '.join(map(str, BITS))}.", code=2)
    if group_size not in GROUP_SIZES:
        fail(f"--kv-group-size {group_size} is not a group size: use one of {', '.join(map(str, GROUP_SIZES))}.", code=2)
    from gmlx.config import KVQuantConfig

    return KVQuantConfig(scheme="uniform", bits=bits, group_size=group_size)


def plan_here(ref: str, width: int, depth: int, kv_quant: KVQuantConfig | None = None) -> dict[str, Any]:
    """The plan for a model loaded here: its table at this machine's free memory; with
    ``kv_quant``, also the plan with its KV so quantized (under ``with_kv_quant``)."""
    from gmlx.engine.admission import offline_plan

    engine, worker, _ = load_here(ref)
    try:
        plan = offline_plan(engine.registry, width, depth, worker)
        quantized = (offline_plan(engine.registry, width, depth, worker, kv_quant.to_kv_quant())
                     if kv_quant is not None else None)
    finally:
        engine.registry.close()
    result = {**plan.as_dict(), "where": "local"}
    if quantized is not None:
        result["with_kv_quant"] = {"kv_bits": kv_quant.bits, "kv_group_size": kv_quant.group_size,  # type: ignore[union-attr]
                                   **quantized.as_dict()}
    return result


def plan_command(
    width: WidthOpt,
    depth: DepthOpt,
    model: OptionalModelArg = None,
    url: ServerUrlOpt = None,
    api_key: ApiKeyOpt = None,
    as_json: JsonOpt = False,
    kv_bits: KVBitsOpt = None,
    kv_group_size: KVGroupOpt = DEFAULT_GROUP_SIZE,
) -> None:
    """Check whether WIDTH streams of DEPTH tokens each fit a model's memory."""
    kv_quant = kv_quant_config(kv_bits, kv_group_size)
    if kv_quant is not None and (url is not None or model is None):
        fail("--kv-bits needs MODEL loaded here (no --url): the plan re-prices the model's own layers.", code=2)
    if url is None and model is not None:
        result = plan_here(model, width, depth, kv_quant)
        where = "here"
    else:
        url = url or DEFAULT_URL
        params: dict[str, Any] = {"width": width, "depth": depth}
        if model:
            params["model"] = model
        result = call_server("GET", url, "/v1/capacity/plan", api_key=api_key, params=params)
        where = url
    fits = result.get("ok") is True
    if as_json:
        typer.echo(json.dumps(result))
    else:
        out = Console()
        title = f"plan: {width} streams x {depth} tokens on {result.get('model')} ({where})"
        quantized = result.pop("with_kv_quant", None)
        out.print(render_table(result, title))
        if quantized is not None:
            out.print(render_table(quantized, f"with --kv-bits {quantized['kv_bits']}: {width} streams x {depth} tokens"))
            verdict = "fits" if quantized.get("ok") else f"does not fit: {quantized.get('detail')}"
            out.print(f"with --kv-bits {quantized['kv_bits']}: {verdict} (max context at width {width}: "
                      f"{quantized.get('max_ctx')} against {result.get('max_ctx')}).")
            if quantized.get("kv_bytes_per_token") == result.get("kv_bytes_per_token"):
                out.print(f"(no layer's KV quantizes at group {quantized['kv_group_size']}: the model's "
                          "head size must be a multiple of it; see --kv-group-size)", markup=False)
        if fits:
            out.print("[bold green]fits[/]" + _admit_line(result) + ".")
        elif result.get("ok") is None:
            out.print(
                "[bold red]cannot be judged:[/] the server has no capacity table "
                "(none was built, or GMLX_OVERCOMMIT=1)."
            )
        else:
            out.print(f"[bold red]does not fit:[/] {result.get('detail')}.")
    raise typer.Exit(0 if fits else 1)


def _admit_line(result: dict[str, Any]) -> str:
    if result.get("admit_now") is None:
        return ""
    if result["admit_now"]:
        return ", and may start now"
    return f", but should wait: {result.get('detail')}"
