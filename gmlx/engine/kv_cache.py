"""The quantized KV cache: one layer's keys and values for a batch of sequences.

It has the interface of mlx-lm's ``BatchKVCache`` (left padding, ``prepare`` /
``finalize`` for right-padded prompts, ``filter``, ``extend``, ``extract``,
``merge``), so mlx-lm's ``BatchGenerator`` runs it at any width; a single sequence
(what the prompt cache stores, what a request starts from) is the same class with a
batch of one. Every token is quantized as it arrives (``mx.quantize`` groups run
along the head dimension, so a token's codes depend on that token alone).

What a query reads depends only on its own position, never on how the prompt was
cut into chunks or whether a prefix came from the prompt cache: so a prefix-cache hit
is exact against a run without it, and a batch against a sequence alone.

    pure   (uniform, past ``start``, where MLX multiplies by codes: the CPU and Metal)
           the attention is mlx-lm's ``quantized_scaled_dot_product_attention`` over
           the codes (the cache then shows ``bits`` and ``group_size``, which is how
           mlx-lm's attention picks it)
    mixed  (kvarn's full-precision tail, different value bits, a query before
           ``start``, or CUDA) the cache returns the dequantized keys followed by a
           full-precision window of the most recent ones, and its mask lets each
           query see every key exactly once: at full precision when the key is among
           its ``tail`` most recent or the query comes before ``start``, else quantized
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, dynamic_roll

from gmlx.engine.kv_quant import KVQuant

Q = tuple[mx.array, mx.array, mx.array]  # codes, scales, biases


@functools.cache
def codes_attention() -> bool:
    """Whether attention may multiply by the cached codes themselves (MLX's quantized
    product with the key count as its N): on the CPU and Metal. MLX's CUDA product has
    kernels for some shapes only (on the H200 a 12-key cache failed with "No
    implementation for problem shape"), and the key count changes every step, so on
    CUDA the cache hands attention dequantized keys and values instead."""
    return mx.default_device().type == mx.DeviceType.cpu or mx.metal.is_available()


def _whole_steps(n: int, step: int) -> int:
    return -(-n // step) * step


def _blank(ref: Q, batch: int, length: int) -> Q:
    """Zero codes, scales and biases shaped like ``ref`` but ``batch`` x ``length``."""
    return tuple(mx.zeros((batch, a.shape[1], length, a.shape[3]), dtype=a.dtype) for a in ref)  # type: ignore[return-value]


class QuantKVCache(_BaseCache):
    """One attention layer's quantized KV for a batch (see the module docstring).

    Args:
        kvq: the scheme.
        left_padding: per sequence, the empty positions before it (a batch of one
            unpadded sequence when None).
    """

    step = 256

    def __init__(self, kvq: KVQuant, left_padding: list[int] | None = None) -> None:
        lp = list(left_padding) if left_padding is not None else [0]
        self.kvq = kvq
        self.group_size = kvq.group_size
        self.kq: Q | None = None  # (B, H, capacity, .) each
        self.vq: Q | None = None
        self.kf: mx.array | None = None  # full precision: the last `window` positions used
        self.vf: mx.array | None = None
        self._lp = lp
        self.left_padding = mx.array(lp)
        self.offset = mx.array([-n for n in lp])
        self._idx = 0
        self._right: list[int] | None = None  # right padding of the prompt chunk in progress
        self._pure = False
        self.head_dims = (0, 0)  # keys', values' (known from the first update)
        self.dtype_bytes = 2  # of the model's keys and values

    # -- what mlx-lm's attention reads ---------------------------------------------------

    @property
    def bits(self) -> int:
        """The codes' width, shown only while the attention runs on them (``hasattr``
        is how mlx-lm's attention tells a quantized cache)."""
        if not self._pure:
            raise AttributeError("bits")
        return self.kvq.key_bits

    @property
    def window(self) -> int:
        return 0 if self.kf is None else self.kf.shape[2]

    def _mixed(self) -> bool:
        """Whether the next chunk's attention needs full-precision keys."""
        k = self.kvq
        if k.tail or k.val_bits != k.key_bits or not codes_attention():
            return True
        return bool(k.start) and min(self._idx - n for n in self._lp) + 1 < k.start

    def _keep(self) -> int:
        """Full-precision positions to keep after an update: every used one while a
        sequence is still short of ``start``, else the tail (plus the right padding a
        ``finalize`` will roll in)."""
        k = self.kvq
        right = self._right or [0] * len(self._lp)
        if k.start and min(self._idx - n - r for n, r in zip(self._lp, right)) + 1 < k.start:
            return self._idx - min(self._lp)
        return min(self._idx, k.tail + k.slack + max(right)) if k.tail else 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        k = self.kvq
        mixed = self._mixed()
        prev, n = self._idx, keys.shape[2]
        self._grow(keys, values, prev + n)
        for store, new in ((self.kq, mx.quantize(keys, group_size=k.group_size, bits=k.key_bits)),
                           (self.vq, mx.quantize(values, group_size=k.group_size, bits=k.val_bits))):
            for dst, src in zip(store, new):  # type: ignore[arg-type]
                dst[..., prev : prev + n, :] = src
        self._idx = prev + n
        self.offset = self.offset + n
        self._pure = not mixed
        if not mixed:
            self.kf = self.vf = None
            return self._used(self.kq), self._used(self.vq)
        kf = keys if self.kf is None else mx.concatenate([self.kf, keys], axis=2)
        vf = values if self.vf is None else mx.concatenate([self.vf, values], axis=2)
        keep = self._keep()
        # A copy, not a view: a view would keep the whole chunk's keys alive.
        self.kf, self.vf = (mx.contiguous(a[..., a.shape[2] - keep :, :]) if keep else None
                            for a in (kf, vf))
        kd = mx.dequantize(*self._used(self.kq), group_size=k.group_size, bits=k.key_bits)
        vd = mx.dequantize(*self._used(self.vq), group_size=k.group_size, bits=k.val_bits)
        return mx.concatenate([kd, kf], axis=2), mx.concatenate([vd, vf], axis=2)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array | None:
        prev = self._idx
        if not self._mixed():
            if N == 1 and not any(self._lp):  # every position is valid: no mask, as a plain cache
                return None
            return create_causal_mask(N, offset=prev, left_padding=self.left_padding)
        k = self.kvq
        rows = mx.arange(prev, prev + N)[:, None]  # the queries' positions in the arrays
        lp = self.left_padding[:, None, None, None]
        early = (rows - lp + 1) < k.start  # (B, 1, N, 1): the query comes before start

        def allowed(cols: mx.array, full: bool) -> mx.array:
            visible = (rows >= cols) & (cols >= lp)
            exact = early | ((rows - cols) < k.tail)
            return visible & (exact if full else ~exact)

        quant = allowed(mx.arange(prev + N)[None], full=False)
        full = allowed(mx.arange(prev - self.window, prev + N)[None], full=True)
        return mx.concatenate([quant, full], axis=-1)

    # -- storage ---------------------------------------------------------------------------

    def _used(self, q: Q | None) -> Q:
        assert q is not None
        if q[0].shape[2] == self._idx:
            return q
        return tuple(a[..., : self._idx, :] for a in q)  # type: ignore[return-value]

    def _grow(self, keys: mx.array, values: mx.array, need: int) -> None:
        """Room for ``need`` positions, in whole steps (as mlx-lm's caches grow)."""
        if self.kq is not None and need <= self.kq[0].shape[2]:
            return
        k = self.kvq
        size = _whole_steps(need, self.step)
        if self.kq is None or self.vq is None:
            self.head_dims, self.dtype_bytes = (keys.shape[3], values.shape[3]), keys.dtype.size
            self.kq = _blank(mx.quantize(keys[:, :, :1], group_size=k.group_size, bits=k.key_bits), keys.shape[0], size)
            self.vq = _blank(mx.quantize(values[:, :, :1], group_size=k.group_size, bits=k.val_bits), values.shape[0], size)
            return
        used = self._idx

        def grown(q: Q) -> Q:
            pad = _blank(q, q[0].shape[0], size - used)
            return tuple(mx.concatenate([a[..., :used, :], p], axis=2) for a, p in zip(q, pad))  # type: ignore[return-value]

        self.kq, self.vq = grown(self.kq), grown(self.vq)

    # -- the batch interface mlx-lm's generator drives ----------------------------------

    def prepare(self, *, left_padding: list[int] | None = None, lengths: Any = None,
                right_padding: list[int] | None = None) -> None:
        if left_padding is not None:
            if self.kq is not None:
                raise ValueError("Left padding can only be added to an empty cache")
            self._lp = [a + b for a, b in zip(self._lp, left_padding)]
            self.left_padding = mx.array(self._lp)
            self.offset = self.offset - mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right = list(right_padding)

    def finalize(self) -> None:
        if self._right is None:
            return
        self._shift_right(self._right)
        self._right = None
        self._trim_window(self._keep())

    def _shift_right(self, shifts: list[int]) -> None:
        """Move each sequence right by ``shifts[i]`` positions in every array, codes and
        full-precision window alike: what rolls out of the end comes back as left
        padding."""
        s = mx.array(shifts)[:, None]
        if self.kq is not None and self.vq is not None:
            self.kq = tuple(dynamic_roll(a, s, axis=2) for a in self.kq)  # type: ignore[assignment]
            self.vq = tuple(dynamic_roll(a, s, axis=2) for a in self.vq)  # type: ignore[assignment]
        if self.kf is not None and self.vf is not None:
            self.kf, self.vf = dynamic_roll(self.kf, s, axis=2), dynamic_roll(self.vf, s, axis=2)
        self.offset = self.offset - s[:, 0]
        self._lp = [n + k for n, k in zip(self._lp, shifts, strict=True)]
        self.left_padding = mx.array(self._lp)

    def _drop_shared_padding(self) -> None:
        """Drop the columns every sequence has as left padding."""
        shift = min(self._lp, default=0)
        if shift > 0:
            if self.kq is not None and self.vq is not None:
                self.kq = tuple(a[..., shift:, :] for a in self.kq)  # type: ignore[assignment]
                self.vq = tuple(a[..., shift:, :] for a in self.vq)  # type: ignore[assignment]
            self._idx -= shift
            self._lp = [n - shift for n in self._lp]
            self._trim_window(self._idx)
        self.left_padding = mx.array(self._lp)

    def _trim_window(self, keep: int) -> None:
        if self.kf is None or self.vf is None or self.window <= keep:
            return
        if keep <= 0:
            self.kf = self.vf = None
            return
        self.kf, self.vf = (mx.contiguous(a[..., a.shape[2] - keep :, :]) for a in (self.kf, self.vf))

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        ids = mx.array(keep)
        if self.kq is not None and self.vq is not None:
            self.kq = tuple(a[ids] for a in self.kq)  # type: ignore[assignment]
            self.vq = tuple(a[ids] for a in self.vq)  # type: ignore[assignment]
        if self.kf is not None and self.vf is not None:
            self.kf, self.vf = self.kf[ids], self.vf[ids]
        self.offset = self.offset[ids]
        self._lp = [self._lp[i] for i in keep]
        self._drop_shared_padding()

    def extend(self, other: QuantKVCache) -> None:
        """Append ``other``'s sequences, both right-justified at the longer one."""
        if self.kq is None and other.kq is None:
            self._lp = self._lp + other._lp
            self.left_padding = mx.array(self._lp)
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        if self.kq is None:
            self.head_dims, self.dtype_bytes = other.head_dims, other.dtype_bytes
        used = max(self._idx, other._idx)
        size = max(c.kq[0].shape[2] for c in (self, other) if c.kq is not None)
        ref_k = (self.kq or other.kq)
        ref_v = (self.vq or other.vq)
        assert ref_k is not None and ref_v is not None
        width = max(self.window, other.window)
        ref_f = next((c for c in (self, other) if c.kf is not None), None)

        def place(c: QuantKVCache) -> tuple[Q, Q, mx.array | None, mx.array | None, list[int]]:
            batch = len(c._lp)
            left = used - c._idx
            right = size - c._idx - left
            out = []
            for q, ref in ((c.kq, ref_k), (c.vq, ref_v)):
                q = q if q is not None else _blank(ref, batch, 0)
                q = tuple(a[..., : c._idx, :] for a in q)
                out.append(tuple(mx.pad(a, [(0, 0), (0, 0), (left, max(0, right)), (0, 0)]) for a in q))
            fulls: list[mx.array | None] = [None, None]
            if ref_f is not None:
                for j, (f, r) in enumerate(((c.kf, ref_f.kf), (c.vf, ref_f.vf))):
                    assert r is not None
                    if f is None:
                        f = mx.zeros((batch, r.shape[1], 0, r.shape[3]), dtype=r.dtype)
                    fulls[j] = mx.pad(f, [(0, 0), (0, 0), (width - f.shape[2], 0), (0, 0)])
            return out[0], out[1], fulls[0], fulls[1], [n + left for n in c._lp]

        a, b = place(self), place(other)
        self.kq = tuple(mx.concatenate(p, axis=0) for p in zip(a[0], b[0]))  # type: ignore[assignment]
        self.vq = tuple(mx.concatenate(p, axis=0) for p in zip(a[1], b[1]))  # type: ignore[assignment]
        if ref_f is not None:
            self.kf = mx.concatenate([a[2], b[2]], axis=0)
            self.vf = mx.concatenate([a[3], b[3]], axis=0)
        self._lp = a[4] + b[4]
        self.left_padding = mx.array(self._lp)
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = used

    def extract(self, idx: int) -> QuantKVCache:
        """Sequence ``idx`` alone, its padding dropped."""
        out = QuantKVCache(self.kvq)
        out.head_dims, out.dtype_bytes = self.head_dims, self.dtype_bytes
        if self.kq is None or self.vq is None:
            return out
        pad = self._lp[idx]
        n = self._idx - pad
        out.kq = tuple(mx.contiguous(a[idx : idx + 1, :, pad : self._idx]) for a in self.kq)  # type: ignore[assignment]
        out.vq = tuple(mx.contiguous(a[idx : idx + 1, :, pad : self._idx]) for a in self.vq)  # type: ignore[assignment]
        keep = min(self.window, n)
        if keep and self.kf is not None and self.vf is not None:
            out.kf, out.vf = (mx.contiguous(a[idx : idx + 1, :, a.shape[2] - keep :]) for a in (self.kf, self.vf))
        out._idx = n
        out.offset = mx.array([n])
        return out

    @classmethod
    def merge(cls, caches: list[QuantKVCache]) -> QuantKVCache:
        """One batch of the sequences ``caches`` hold (each a batch of one or more)."""
        first = caches[0]
        batch = cls(first.kvq, list(first._lp))
        batch.kq, batch.vq, batch.kf, batch.vf = first.kq, first.vq, first.kf, first.vf
        batch.offset, batch._idx = first.offset, first._idx
        batch.head_dims, batch.dtype_bytes = first.head_dims, first.dtype_bytes
        for c in caches[1:]:
            batch.extend(c)
        return batch

    # -- the rest of mlx-lm's cache interface ---------------------------------------------

    @property
    def state(self) -> list[mx.array]:  # type: ignore[override]
        arrays = [*(self.kq or ()), *(self.vq or ()), self.kf, self.vf, self.offset, self.left_padding]
        return [a for a in arrays if a is not None]

    def is_trimmable(self) -> bool:
        return self.kvq.trimmable

    def shift_rows(self, shifts: list[int]) -> None:
        """Move each sequence right by ``shifts[i]`` positions, its last ones out and
        left padding in, then drop the padding every sequence shares: what a speculative
        round's verification does to rows that kept fewer of the round's positions
        (``spec_cache.trim_rows``). The full-precision window moves with its rows: what
        rolls into a row's first window positions is either its padding or at least
        ``tail + 1`` positions back, which no query reads at full precision, as long as
        the scheme's ``slack`` covers the round (``KVQuant.for_drafts``)."""
        assert not self.kvq.start and (not self.kvq.tail or self.kvq.slack > max(shifts))
        self._shift_right(shifts)
        self._drop_shared_padding()

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        if n and self.kf is not None and self.vf is not None:  # the window ends where the cache does
            w = self.window - n
            self.kf, self.vf = (a[..., :w, :] for a in (self.kf, self.vf)) if w > 0 else (None, None)
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.kq is None

    @property
    def nbytes(self) -> int:
        arrays = [*(self.kq or ()), *(self.vq or ()), self.kf, self.vf]
        return sum(a.nbytes for a in arrays if a is not None)

