"""Custom kernels, each used only where it is built and where it measured faster."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def prepare_layers(model: Any) -> list[str]:
    """``model``'s layers as the engine runs them: llama-pattern attention's one-token
    steps in fewer operations (:mod:`one_token`; everywhere, the same numbers; with
    ``GMLX_ROPE_KERNEL=1`` on CUDA their queries and keys rotated by :mod:`rope_cuda`), with
    ``GMLX_FUSE_PROJECTIONS=1`` projections that read one input stacked into one product
    (logged, not a load note: neither changes a number a user sees), else with
    ``GMLX_STACKED=1`` on CUDA a block's same-layout q-k-v and gate-up weights stacked into
    one array each, the layers keeping views of their rows (:mod:`stacked`, logged), then, on CUDA (unless
    turned off), the padded batches' one-query attention (:mod:`attention_cuda`, logged
    likewise), with ``GMLX_ADD_NORM_KERNEL=1`` the residual adds and norms of one-token
    steps fused (:mod:`add_norm_cuda`, logged likewise), the quantized layers' paths, then
    (unless ``GMLX_GLU_KERNEL=0``) an MLP's gate and up projections and swiglu in one
    kernel (:mod:`glu_cuda`) and (unless ``GMLX_QKV_KERNEL=0``) an attention's queries,
    keys and values in one product (:mod:`qkv_cuda`) for the one-token steps where each
    measures faster, and (unless ``GMLX_NORM_FOLD=0``) where an MLP takes the gated
    kernel at one stream, the block's norm before it folded into that kernel
    (:func:`glu_cuda.fold_norms`, logged; unless ``GMLX_QKV_NORM=0`` the norm before the
    attention into its projections' product, :func:`qkv_cuda.fold_norms`). The one-token steps of llama-pattern blocks run in two compiled pieces
    each (:mod:`compiled_blocks`, logged; on the CPU and CUDA unless ``GMLX_COMPILE_BLOCKS=0``),
    attached before the tuners, so they time whole steps as they will be served (a custom
    kernel's host cost paid at a trace, not every step), and traced again after them with
    the paths they chose; on CUDA (unless ``GMLX_WHOLE_STEP=0`` or
    ``GMLX_CACHE_ATTENTION=0``) the whole one-token step is one compiled call (:mod:`whole_step`), likewise;
    on CUDA a greedy step's argmax is checked once a process (:func:`argmax_cuda.check`). Returns the load notes."""
    from gmlx.engine import mlxlm
    from gmlx.engine.kernels import (
        add_norm_cuda,
        argmax_cuda,
        attention_cuda,
        cached_attention_cuda,
        compiled_blocks,
        glu_cuda,
        one_token,
        qkv_cuda,
        stacked,
        whole_step,
    )
    from gmlx.engine.kernels.fast_linear import use_fast_kernels
    from gmlx.engine.kernels.fused import fuse_projections

    in_place = False
    if changed := one_token.attach(model):
        log.info("one-token steps of %d attention layer(s) in fewer operations", changed)
        in_place = cached_attention_cuda.cached_enabled() and compile_in_place(model)
    if (fusing := fuse_projections(model)) is not None:
        log.info("%s", fusing)
    elif stacked.enabled() and (line := stacked.attach(qkv_cuda.stackable(model), glu_cuda.stackable(model))):
        log.info("%s", line)  # (before any kernel is bound to the layers' arrays)
    if attention_cuda.enabled():
        mlxlm.route_attention(attention_cuda.routed)
        log.info("cuda: a padded batch's one-query attention runs in gmlx's kernel")
    if add_norm_cuda.enabled() and (fused := add_norm_cuda.attach(model)):
        log.info("cuda: the residual adds and norms of %d block(s) fused for one-token steps", fused)
    if compiled_blocks.enabled() and (compiled := compiled_blocks.attach(model)):
        log.info("one-token steps of %d block(s) in two compiled pieces each", compiled)
    if whole_step.enabled() and in_place and whole_step.attach(model):
        log.info("cuda: one-token steps over a batch cache in one compiled call")
    # the step kernels below are taken where their tune() measures a whole step faster
    step_kernels = [k for k in (glu_cuda, qkv_cuda) if k.enabled() and k.attach(model, buckets=())]
    notes = [note] if (note := use_fast_kernels(model)) is not None else []
    for kernel in step_kernels:
        try:
            decided = kernel.tune(model)
        except Exception as error:  # noqa: BLE001 - a kernel that fails here must not fail the load
            kernel.detach(model)
            log.warning("cuda: %s is not used: %s", kernel.__name__.rsplit(".", 1)[-1], error)
            decided = None
        if decided is not None:
            notes.append(decided)
    for kernel in (k for k in (glu_cuda, qkv_cuda) if k in step_kernels):
        try:
            if (line := kernel.fold_norms(model)) is not None:
                log.info("%s", line)
        except Exception as error:  # noqa: BLE001 - the norms stay MLX's; the load goes on
            log.warning("cuda: the norms are not folded into %s's kernels: %s", kernel.__name__.rsplit(".", 1)[-1],
                        error)
    compiled_blocks.retrace(model)  # the paths and kernels the tuners left in place
    if (line := argmax_cuda.check()) is not None:  # once a process, before a greedy step takes it
        log.info("%s", line)
    if argmax_cuda.agrees():
        mlxlm.route_greedy(argmax_cuda.greedy)
    return notes


def compile_in_place(model: Any) -> bool:
    """Compile the in-place attention for ``model``'s attention shapes before it reports
    ready (:func:`cached_attention_load.compile_cached`) and time where its split form
    starts to pay on this GPU (:func:`cached_attention_load.tune_splits`); whether any
    layer now writes in place. A kernel that does not compile or launch here (an NVRTC error, a launch MLX
    refuses) must not fail the load: its layers then attend through mlx-lm's cache, and
    no whole step is traced over them (it needs the in-place writes)."""
    from gmlx.engine.kernels import cached_attention_load, one_token

    try:
        shapes = cached_attention_load.compile_cached(model)
    except RuntimeError as error:
        log.warning("cuda: the in-place attention is not used: %s", str(error).splitlines()[0][:200])
        one_token.detach(model)
        one_token.attach(model, in_place=False)
        return False
    if shapes:
        log.info("cuda: the in-place attention compiled for %d shape(s), whole and split", shapes)
        try:
            for line in cached_attention_load.tune_splits(model):
                log.info("cuda: the in-place attention, %s", line)
        except RuntimeError as error:  # a timing that fails leaves the default threshold, not the load
            log.warning("cuda: the in-place attention splits as by default: %s", str(error).splitlines()[0][:200])
    return shapes > 0

