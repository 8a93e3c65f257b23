"""Where a served request's time to first token goes: one model served by gmlx (and by
mlx_lm.server, for an MLX folder), short streaming requests one after another, the
same prompts measured in process through gmlx's worker, and, where ``py-spy`` is
installed, a sampled profile of the gmlx server's threads while it answers them.

    python benchmarks/gpu/ttft_profile.py /tmp/models/tiny/mlx-bf16 --peer --profile $OUT/gmlx.speedscope.json

A tiny model makes the compute nearly free, so what is left of the TTFT is what the
server adds (on the H200 an 8B's served width-1 TTFT was 139-231 ms for a 128-token
prompt, llama-server's 56). Each request is a new ``--prompt``-token prompt (a miss),
``--tokens`` tokens out, with and without bench.py's logit bias (every special and
partial-UTF-8 token at -100). Prints one row per server and bias: TTFT p50 / p95 / min
and the whole request's p50.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import openai
import throughput as tp

from benchmarks.gpu import bench


async def drive(s: tp.Server, prompts: tp.Prompts, args: argparse.Namespace, bias: dict[str, int],
                tag: str) -> tuple[list[float], list[float]]:
    """TTFT and whole-request seconds of ``--requests`` sequential requests."""
    client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0,
                                timeout=tp.REQUEST_TIMEOUT_S)
    try:
        if not s.model:
            s.model = (await client.models.list()).data[0].id
        ttft, total = [], []
        for i in range(args.requests + 2):
            length = args.prompt + (i if args.vary else 0)
            msg = [{"role": "user", "content": prompts.text(f"{tag}{i}{s.name}", length)}]
            st = await tp.stream_chat(client, s.model, msg, args.tokens, bias)
            if i >= 2:  # two untimed first
                ttft.append(st.ttft)
                total.append(st.end - st.sent)
        return ttft, total
    finally:
        await client.close()


def row(name: str, bias: str, ttft: list[float], total: list[float]) -> str:
    q = statistics.quantiles(ttft, n=20) if len(ttft) > 1 else ttft * 19
    return (f"| {name} | {bias} | {statistics.median(ttft) * 1e3:.1f} | {q[18] * 1e3:.1f} | "
            f"{min(ttft) * 1e3:.1f} | {statistics.median(total) * 1e3:.1f} |")


def in_process(model: str, prompts: tp.Prompts, args: argparse.Namespace) -> list[float]:
    """The same prompts' TTFT through gmlx's worker in this process, warmed up as a
    served model is (token ids in, no HTTP, no chat template, no logit bias): what the
    server costs on top."""
    from benchmarks.decode_throughput import worker_ttft
    from gmlx.engine import capacity
    from gmlx.engine.loading import load_model
    from gmlx.engine.scheduling import default_prefill_step
    from gmlx.engine.warmup import warm_up
    from gmlx.engine.worker import ModelWorker

    loaded = load_model(model)
    # the buffer-cache allowance a server's worker gets (model_start), so that the
    # buffers one prompt's prefill frees are reused by the next, as there
    geom = capacity.probe_geometry(loaded, None)
    allowance = capacity.prefill_transient(geom, default_prefill_step(), loaded.context_length)
    worker = ModelWorker(loaded, decode_batch=max(1, args.decode_batch), buffer_cache_bytes=allowance)
    try:
        warm_up(worker)  # as the server's model was, before it reported ready
        out = []
        for i in range(args.requests + 2):
            msg = [{"role": "user", "content": prompts.text(f"proc{i}", args.prompt + (i if args.vary else 0))}]
            text = prompts.tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
            ids = prompts.tok.encode(text, add_special_tokens=False)
            first = worker_ttft(worker, ids, args.tokens)
            if i >= 2:
                out.append(first)
        return out
    finally:
        worker.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="a GGUF or an MLX folder (its tokenizer: the folder, or "
                                             "tokenizer/ beside the GGUF)")
    p.add_argument("--peer", action="store_true", help="also mlx_lm.server (MLX folders only)")
    p.add_argument("--gmlx", default="gmlx",
                   help="comma-separated gmlx servers: bench.py's names, e.g. gmlx,gmlx-cudnn (each in "
                        "its environment)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--vary", action="store_true",
                   help="each request one token longer than the last: a shape a step has not run yet "
                        "may compile (kernels, cuDNN graphs) inside that request")
    p.add_argument("--profile", type=Path, help="py-spy's speedscope profile of the gmlx server, here")
    p.add_argument("--gmlx-args", type=lambda s: s.split(), default=[])
    p.add_argument("--gmlx-home", type=Path,
                   help="one GMLX_HOME for every gmlx server (bench.py's option: a conversion and tuning done once)")
    p.add_argument("--start-timeout", type=float, default=420.0,
                   help="seconds until a server is ready (a first GGUF load converts and tunes: minutes)")
    args = p.parse_args()
    tp.START_TIMEOUT_S = args.start_timeout
    folder = args.model if args.model.is_dir() else args.model.parent / "tokenizer"
    prompts = tp.Prompts(folder)
    no_bias: dict[str, int] = {}
    bias = {str(i): -100 for i in prompts.banned_ids}
    server_args = SimpleNamespace(widths=[args.decode_batch], gmlx_args=args.gmlx_args, peer_args=[],
                                  llama_args=[], prompt=args.prompt, prefix=0, tokens=args.tokens,
                                  gmlx_home=args.gmlx_home)
    kinds = args.gmlx.split(",") + (["mlx_lm"] if args.peer and args.model.is_dir() else [])
    if bad := [k for k in kinds if k not in bench.SERVERS or k in ("llama", "gmlx-mlx")]:
        raise SystemExit(f"not a server here: {', '.join(bad)}")
    lines = ["| server | logit bias | TTFT p50 ms | p95 ms | min ms | request p50 ms |", "|---|---|---:|---:|---:|---:|"]
    workdir = Path(tempfile.mkdtemp(prefix="ttft-"))
    try:
        for kind in kinds:
            s = bench.make_server(kind, args.model, workdir, server_args)
            s.start()
            spy = None
            try:
                s.wait_ready()
                asyncio.run(drive(s, prompts, args, no_bias, "warm"))
                if kind == kinds[0]:
                    spy = bench.start_profile(s, args.profile, rate=1000, native=False)
                for label, b in (("none", no_bias), (f"{len(bias)} ids", bias)):
                    ttft, total = asyncio.run(drive(s, prompts, args, b, label[:4]))
                    lines.append(row(kind, label, ttft, total))
                    print(lines[-1], flush=True)
            except Exception as e:  # noqa: BLE001 (the table keeps the failure)
                lines.append(f"| {kind} | failed: {type(e).__name__}: {str(e)[:200]} | | | | |")
                print(lines[-1], "\n", s.tail(30), flush=True)
            finally:
                bench.stop_profile(spy, timeout=30)
                s.stop()
        ttft = in_process(str(args.model), prompts, args)
        lines.append(row("gmlx worker, in process", "none", ttft, ttft))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{args.model.name}: {args.prompt}-token prompts, {args.tokens} tokens out, "
          f"{args.requests} requests one after another\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
