"""The fused CPU block (kernels/block_bf16.c; block_avx2.c without AVX512): when it runs and with what.

Owns: deciding whether a model's blocks can each run as one C call, the ctypes mirrors of
the kernel's structs, and the layer loop of a pass through it.
Does not own: the embedding, final norm and LM head (transformer.py), where K/V live (each
cache's `storage_index`), or building the library (cpu_int4.py).

It runs Llama-style blocks (no biases, qk-norm, sandwich norms or sliding windows; SiLU) in
bf16 whose four linears all use our int4 kernel, on CPU, without autograd. A decode step of
a small model then costs its int4 matmuls plus a small fixed cost per layer, where the torch
ops dispatched around them cost more than the matmuls themselves. Every token is computed
alone (see the kernel's header), so passes through it are batch-invariant whether or not
``batch_invariant`` is asked for. Passes of more than MAX_POSITIONS tokens run the torch blocks.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

import torch
from torch import Tensor, nn

from specdecode.config import SpecDecodeError
from specdecode.cache.kv_cache import StorageIndex
from specdecode.model.cpu_int4 import CPU_ISAS, cpu_isa, cpu_lib
from specdecode.model.quant import Int4Linear


# Larger passes (prefill chunks, big batches) run the torch blocks: there the kernel's
# one-query-at-a-time attention and its bf16 GEMM (built for few rows) lose to SDPA and
# oneDNN, more the longer the pass; around this size the two are about even
# (benchmarks/bench_block.py compares them).
MAX_POSITIONS = 64


class _QLinear(ctypes.Structure):
    _fields_ = [("wp", c_void_p), ("sz", c_void_p), ("n", c_int), ("k", c_int), ("kind", c_int)]


_INT4, _BF16, _INT4_A8 = 0, 1, 2  # QLinear.kind (kernels/block.h)


class _BlockWeights(ctypes.Structure):
    _fields_ = [
        ("hidden", c_int), ("heads", c_int), ("kv_heads", c_int), ("head_dim", c_int), ("inter", c_int),
        ("eps", c_float), ("scale", c_float), ("attn_norm", c_void_p), ("mlp_norm", c_void_p),
        ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear), ("down", _QLinear),
    ]  # fmt: skip


class _Pass(ctypes.Structure):
    _fields_ = [
        ("M", c_int), ("T", c_int), ("row", c_void_p), ("t", c_void_p), ("prefix", c_void_p), ("vis", c_void_p),
        ("cos", c_void_p), ("sin", c_void_p), ("slot_map", c_void_p), ("map_stride", c_int),
        ("slot_stride", c_int64), ("head_stride", c_int64), ("threads", c_int),
    ]  # fmt: skip


def _fingerprint(model: nn.Module) -> tuple[int, ...]:
    """Where the first and last blocks' norms and weights live: ``.to`` / ``.float()`` move the
    norms (int4 weights are integers and stay). The structs keep the old storages alive, so a
    moved model is caught here rather than read stale. (Swapping a linear goes through
    quant.set_submodule, which drops the structs.) Cheap: a few pointer reads a pass."""
    first, last = model.layers[0], model.layers[-1]
    return (first.attn_norm.weight.data_ptr(), first.attn.qkv.weight.data_ptr(),
            last.mlp_norm.weight.data_ptr(), last.mlp.down.weight.data_ptr())  # fmt: skip


def _qlinear(lin: nn.Module, isa: str) -> _QLinear | None:
    """The kernel's view of a linear: our int4 layout, or a plain bf16 weight read in place."""
    if type(lin) is nn.Linear:
        w = lin.weight
        ok = w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous() and w.shape[1] % 32 == 0
        ok = ok and w.shape[0] % 8 == 0
        return _QLinear(w.data_ptr(), None, w.shape[0], w.shape[1], _BF16) if ok and lin.bias is None else None
    ok = isinstance(lin, Int4Linear) and lin.impl == isa and lin.input_planes == 1
    if not ok or lin.k_pad or lin.n_pad or lin.bias is not None:
        return None
    kind = _INT4_A8 if lin.a8 else _INT4
    return _QLinear(lin.weight.data_ptr(), lin.scales_and_zeros.data_ptr(), lin.out_features, lin.in_features, kind)


class CpuBlocks:
    """A model's blocks as the kernel's weight structs; build with `CpuBlocks.build`."""

    def __init__(
        self, model: nn.Module, isa: str, weights: list[_BlockWeights], keep: list[Tensor], head: _QLinear | None
    ) -> None:
        self.isa, self.lib = isa, cpu_lib(isa)  # which build of our library runs the blocks
        self.weights, self._head = weights, head  # head: a bf16 LM head, which our GEMM reads faster than torch
        self._built_from = _fingerprint(model)
        self._addresses = [ctypes.addressof(w) for w in weights]
        self._keep = keep  # the tensors the structs point into: alive as long as this is
        self._causal_tables: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}

    @staticmethod
    def build(model: nn.Module, isa: str | None = None) -> CpuBlocks | None:
        """For a `Transformer` whose every block the kernel can run, through our library's ``isa``
        build (its int4 linears must use the same build; any other int4 kernel name, or None: the
        best the host CPU runs); else None."""
        if model.embed.weight.device.type != "cpu":
            return None  # before cpu_isa(): a model on CUDA neither builds nor probes our C library
        isa = isa if isa in CPU_ISAS else cpu_isa()
        cfg = model.config
        plain = cfg.activation == "silu" and cfg.norm_offset == 0 and not cfg.sandwich_norm
        plain = plain and not (cfg.attention_bias or cfg.attention_out_bias or cfg.mlp_bias or cfg.qk_norm)
        plain = plain and cfg.sliding_window is None
        G, D = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        shapes = G <= 8 and D % 16 == 0 and D <= 256 and cfg.hidden_size % 32 == 0 and cfg.intermediate_size % 16 == 0
        bf16 = model.embed.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.bfloat16
        if not (plain and shapes and bf16) or isa is None or cpu_lib(isa) is None:
            return None
        weights, keep = [], []
        for block in model.layers:
            lins = [_qlinear(m, isa) for m in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down)]
            norms = (block.attn_norm.weight, block.mlp_norm.weight)
            if None in lins or any(n.dtype != torch.bfloat16 or n.device.type != "cpu" for n in norms):
                return None
            H, I, Q = cfg.hidden_size, cfg.intermediate_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * D
            shapes = [(Q, H), (H, cfg.num_heads * D), (2 * I, H), (H, I)]  # the kernel sizes its buffers so
            if [(q.n, q.k) for q in lins] != shapes:
                return None
            weights.append(_BlockWeights(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, D, cfg.intermediate_size,
                cfg.rms_norm_eps, block.attn.scale, norms[0].data_ptr(), norms[1].data_ptr(), *lins,
            ))  # fmt: skip
            keep += [t.detach() for t in (*block.parameters(), *block.buffers())]  # the storages, not the Parameters
        head = _qlinear(model.lm_head, isa)  # any module; only a plain bf16 Linear is ours to run
        head = head if head is not None and head.kind == _BF16 else None
        keep += [] if head is None else [model.lm_head.weight.detach()]
        return CpuBlocks(model, isa, weights, keep, head)

    def applies(self, x: Tensor, model: nn.Module, batch_invariant: bool) -> bool:
        """For ``x`` [..., H], the pass's inputs: bf16 on CPU, no autograd, at most MAX_POSITIONS
        unless ``batch_invariant`` (then every pass, so that no position's logits depend on
        which path its pass took). Raises if ``model``'s weights moved since `build`."""
        ok = x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
        if not (ok and (batch_invariant or x.numel() <= MAX_POSITIONS * x.shape[-1])):
            return False
        if _fingerprint(model) != self._built_from:
            raise SpecDecodeError("the model's weights moved after use_cpu_blocks(); call it again")
        return True

    @staticmethod
    def fits(store: StorageIndex | None) -> bool:
        """Whether the kernel can write the cache in place: bf16, CPU, contiguous storage."""
        k = None if store is None else store.keys[0]
        return k is not None and k.dtype == torch.bfloat16 and k.device.type == "cpu" and k.is_contiguous()

    def _causal(self, B: int, T: int) -> tuple[Tensor, Tensor, Tensor]:
        """Row and step (int64 [B·T]) of each position of an unpacked B x T pass, and its causal
        visibility within the pass (uint8 [B·T, T]); kept for the passes the kernel takes by
        default (at most MAX_POSITIONS), which are most passes: never written after."""
        tables = self._causal_tables.get((B, T))
        if tables is None:
            t = torch.arange(T).repeat(B)
            tables = (torch.arange(B).repeat_interleave(T), t, (t[:, None] >= torch.arange(T)).to(torch.uint8))
            if B * T <= MAX_POSITIONS:
                self._causal_tables[B, T] = tables
        return tables

    def head(self, x: Tensor, lm_head: nn.Module) -> Tensor:
        """``lm_head(x)`` [..., V]: through our bf16 GEMM when the head is a bf16 weight."""
        if self._head is None or x.dtype != torch.bfloat16:
            return lm_head(x)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty(x2.shape[0], self._head.n, dtype=torch.bfloat16)
        self.lib.bf16_gemm(x2.data_ptr(), x2.shape[0], self._head.k, self._head.wp, self._head.n, y.data_ptr(), torch.get_num_threads())
        return y.view(*x.shape[:-1], -1)

    def run(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        lengths: Tensor,
        store: StorageIndex,
        block_mask: Tensor | None,
        pack: Tensor | None,
        want: set[int],
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """The layers over ``x`` ([B, T, H], or [N, H] for the real tokens ``pack`` of a padded
        pass): the residual stream after the last layer, and after each layer in ``want``.
        ``rope`` is the pass's cos and sin [B, T, D/2] (`Transformer.rope_angles`)."""
        B, T, half = rope[0].shape
        row, t, vis8 = self._causal(B, T)
        cos, sin = (r.reshape(B * T, half) for r in rope)  # [B·T, D/2]
        if pack is not None:  # a padded pass: its real tokens only
            flat = pack.cpu()
            row, t, vis8, cos, sin = row[flat], t[flat], vis8[flat], cos[flat], sin[flat]
        if block_mask is not None:  # a tree: what the mask lets each token see, and itself
            vis8 = (block_mask.cpu().to(torch.bool)[row, t] | (t[:, None] == torch.arange(T))).to(torch.uint8)
        row32, t32, prefix32 = row.int(), t.int(), lengths.cpu()[row].int()
        cos, sin, vis8, index = cos.contiguous(), sin.contiguous(), vis8.contiguous(), store.index.contiguous()
        args = _Pass(
            row32.numel(), T, row32.data_ptr(), t32.data_ptr(), prefix32.data_ptr(), vis8.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), index.data_ptr(), index.shape[1],
            store.slot_stride, store.head_stride, torch.get_num_threads(),
        )  # fmt: skip
        shape = x.shape
        h = x.reshape(-1, shape[-1]).clone(memory_format=torch.contiguous_format)  # row-major for C; updated in place
        hiddens: dict[int, Tensor] = {}
        block_forward = self.lib.block_forward
        where, keys, values = ctypes.addressof(args), store.keys, store.values
        last = len(self._addresses) - 1
        for i, weights in enumerate(self._addresses):
            block_forward(h.data_ptr(), weights, where, keys[i].data_ptr(), values[i].data_ptr())
            if i in want:  # the last block's output is final: no copy (EAGLE's feature, every pass)
                hiddens[i] = (h if i == last else h.clone()).view(shape)
        return h.view(shape), hiddens
