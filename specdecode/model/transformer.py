"""One decoder-only transformer for every supported architecture, chosen by config flags.

Owns: the forward pass that writes K/V through a `KVCache`, for every architecture that
`ModelConfig` (model_config.py, re-exported here) describes by its flags.
Does not own: attention masks for chains, trees and ragged batches (masks.py), the split and
per-query attention paths (attention.py), RoPE frequency formulas (rope.py), reading
checkpoints (loader.py), advancing or rolling back the cache (the engine's `commit` /
`truncate`), or the cut of a tensor-parallel shard (shard.py: a shard's layers hold its heads
and sum their row-parallel outputs across ranks).

Architectures as flags: Llama / SmolLM2 / Mistral (plain), Qwen2 (qkv bias), Qwen3
(qk-norm), Gemma3 text (qk-norm, (1+w) norms, sandwich norms, scaled embeddings, gelu_tanh,
local sliding-window layers with their own RoPE base, query scalar, optional final logit
soft-capping). Q/K/V and gate/up are fused Linears (few kernel launches per layer); masks
and RoPE tables are built once per forward and shared by all layers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.cache.kv_cache import ContiguousKVCache, KVCache
from specdecode.cache.paged_cache import PagedKVCache
from specdecode.model.cpu_block import MAX_POSITIONS, CpuBlocks
from specdecode.model import attention, invariant
from specdecode.model.cpu_int4 import cpu_rms_norm, fast_cpu_norm
from specdecode.model.masks import FULL, SLIDING, attention_masks, split_plan, visible_keys
from specdecode.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from specdecode.model.rope import apply_rope, rope_frequencies
from specdecode.model.shard import Shard

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RMSNorm", "Transformer", "apply_rope"]


class RMSNorm(nn.Module):
    """RMSNorm in fp32. Llama-style casts before scaling by w; Gemma-style scales by (1 + w) in fp32."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset, self.dim = eps, offset, (dim,)
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        if fast_cpu_norm(x, self.weight):  # one C call instead of ~8 dispatched ops (decode is overhead-bound)
            return cpu_rms_norm(x, self.weight, self.eps, self.offset)
        if self.offset:
            h = F.rms_norm(x.float(), self.dim, eps=self.eps)
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        # rms_norm upcasts reduced-precision input itself and rounds once: same as x.float() ... .to(x.dtype)
        return F.rms_norm(x, self.dim, eps=self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard | None = None) -> None:
        super().__init__()
        self.layer, self.qk_norm, self.kind = layer, cfg.qk_norm, cfg.layer_types[layer]
        self.heads, self.kv_heads = shard.heads(cfg) if shard else (cfg.num_heads, cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.qkv = nn.Linear(cfg.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=cfg.attention_bias)
        self.o = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, step: _Step) -> Tensor:
        """``mask`` is [B, 1, G*T, S] (query rows folded, see masks.attention_masks) or None (causal / T == 1)."""
        B, T = step.slots.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        qkv = step.unpack(step.linear(self.qkv, x)).view(B, T, H + 2 * Hkv, D)
        v = qkv[:, :, H + Hkv :]
        if self.qk_norm:
            q, k = qkv[:, :, :H], qkv[:, :, H : H + Hkv]
            q, k = apply_rope(self.q_norm(q), *rope), apply_rope(self.k_norm(k), *rope)
        else:  # one RoPE over q and k together
            q, k = apply_rope(qkv[:, :, : H + Hkv], *rope).split((H, Hkv), dim=2)
        out = self._attend(q, k, v, mask, step)
        return step.reduce(step.linear(self.o, step.pack_rows(out.reshape(B, T, H * D))))

    # Eager even inside a compiled block: model/compiled.py marks it so when it first compiles
    # (not here: torch.compiler.disable imports dynamo, slow at every start). The cache's
    # bookkeeping, the layer index and the pass's KV length would otherwise specialise a
    # graph per layer and step.
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, step: _Step) -> Tensor:
        """Write this pass's K/V [B, T, Hkv, D] and attend with queries [B, T, H, D]; the output
        holds B·T·H·D values (callers reshape it to [B, T, H·D])."""
        B, T = step.slots.shape
        Hkv, G, D = self.kv_heads, self.group, self.head_dim
        k, v = step.cache.append(self.layer, k.transpose(1, 2), v.transpose(1, 2), step.slots, step.kv_len)
        if step.vis is not None:  # our row-invariant kernel (model/invariant.py)
            out = invariant.attend(q, k, v, step.vis[self.kind], self.scale)
        elif step.visible is not None:
            out = attention.rowwise(q, k, v, step.visible[self.kind], self.scale)
        elif step.split is not None:
            out = attention.split(q, k, v, step.split, *step.split_masks[self.kind], self.scale)
        elif mask is None and T > 1:  # causal prefill of one row with an empty cache
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, scale=self.scale, enable_gqa=G > 1
            ).transpose(1, 2)
        else:  # fold each kv head's G query heads into the query axis: no K/V repeat
            q = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out = out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        inter = shard.intermediate(cfg) if shard else cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = F.silu if cfg.activation == "silu" else lambda h: F.gelu(h, approximate="tanh")

    def forward(self, x: Tensor, step: _Step | None = None) -> Tensor:
        if step is None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
        gate, up = step.linear(self.gate_up, x).chunk(2, dim=-1)
        return step.reduce(step.linear(self.down, self.act(gate) * up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard | None = None) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        self.attn_norm, self.attn, self.mlp_norm = norm(), Attention(cfg, layer, shard), norm()
        self.mlp = MLP(cfg, shard)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.attn_out_norm, self.mlp_out_norm = norm(), norm()

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, step: _Step) -> Tensor:
        h = self.attn(self.attn_norm(x), rope, mask, step)
        x = x + (self.attn_out_norm(h) if self.sandwich else h)
        h = self.mlp(self.mlp_norm(x), step)
        return x + (self.mlp_out_norm(h) if self.sandwich else h)


@dataclass
class _Step:
    """What every layer of one forward pass shares."""

    cache: KVCache
    slots: Tensor  # [B, T] cache slots written by this pass
    kv_len: int
    # batch-invariant mode: per layer kind, the key slots each query (b, t) sees, in order
    # (a slice when they are contiguous, as for every chain: no gather)
    visible: dict[str, list[list[Tensor | slice]]] | None = None
    # packed pass: flat indices (into B*T) of the real tokens; the linears see only them [N, H]
    pack: Tensor | None = None
    # split attention (few rows draft deep): those rows [R], and per layer kind the folded
    # mask's rows for every row's first query [B, 1, G, S] and for their later ones [R, 1, G*(T-1), S]
    split: Tensor | None = None
    split_masks: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # row-invariant pass on CPU (model/invariant.py): our GEMMs for dense linears, and per layer
    # kind the slots each query sees [B·T, S] uint8 for our attention (set by `_layers`)
    exact: bool = False
    vis: dict[str, invariant.Visibility] | None = None
    shard: Shard | None = None  # tensor parallel: the row-parallel linears' outputs are summed over ranks

    def reduce(self, x: Tensor) -> Tensor:
        return x if self.shard is None else self.shard.reduce(x)

    def linear(self, module: nn.Module, x: Tensor) -> Tensor:
        return invariant.linear(module, x) if self.exact else module(x)

    def unpack(self, x: Tensor) -> Tensor:
        """[N, F] packed rows -> [B, T, F] with zeros at padding (identity when not packed)."""
        if self.pack is None:
            return x
        B, T = self.slots.shape
        full = x.new_zeros(B * T, x.shape[-1])
        full[self.pack] = x
        return full.view(B, T, -1)

    def pack_rows(self, x: Tensor) -> Tensor:
        """[B, T, F] -> [N, F], the real tokens only (identity when not packed)."""
        return x if self.pack is None else x.reshape(-1, x.shape[-1])[self.pack]


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        """``shard``: this rank's part of a tensor-parallel model (shard.py); its heads, its MLP
        slice and its LM-head rows (embeddings and norms whole)."""
        super().__init__()
        self.config = cfg = config
        self.shard = shard if shard is not None and shard.size > 1 else None
        # rank 0 of a tensor-parallel model: tells the other ranks what to run (tensor_parallel.py)
        self.lead: Any = None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, self.shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        vocab = self.shard.vocab_rows(cfg) if self.shard else cfg.vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_embeddings and self.shard is None:
            self.lm_head.weight = self.embed.weight
        self.cpu_blocks: CpuBlocks | None = None  # set by `use_cpu_blocks` once the weights are final
        # fp32 on CPU even under a meta-device context; the loader moves them with the weights.
        self.rope_scale: dict[str, float] = {}
        for kind, rope in ((FULL, cfg.rope), (SLIDING, cfg.local_rope or cfg.rope)):
            inv_freq, self.rope_scale[kind] = rope_frequencies(rope, cfg.head_dim)
            self.register_buffer(f"inv_freq_{kind}", inv_freq, persistent=False)

    def use_cpu_blocks(self, isa: str | None = None) -> bool:
        """Run the blocks through our fused CPU kernel from now on, where it applies (cpu_block.py),
        built for ``isa`` (the int4 kernel its linears use; "auto", "stock" or None: the best this
        CPU runs). Call it after the weights are loaded, quantized and placed. Not for a
        tensor-parallel shard: the fused block has no all-reduce inside."""
        self.cpu_blocks = None if self.shard else CpuBlocks.build(self, isa)
        return self.cpu_blocks is not None

    def fused_positions(self, batch_invariant: bool = False) -> int:
        """The most positions a pass may hold and still run the fused CPU block: 0 where it does
        not run, every pass in batch-invariant mode (`CpuBlocks.applies`)."""
        if self.cpu_blocks is None:
            return 0
        return sys.maxsize if batch_invariant else MAX_POSITIONS

    @property
    def kv_heads(self) -> int:  # what this rank's caches hold
        return self.shard.heads(self.config)[1] if self.shard else self.config.num_kv_heads

    def new_cache(self, batch_size: int, capacity: int) -> ContiguousKVCache:
        c, w = self.config, self.embed.weight
        cache = ContiguousKVCache(c.num_layers, batch_size, self.kv_heads, c.head_dim, capacity, w.dtype, w.device)
        return cache if self.lead is None else self.lead.mirror(cache, ("contiguous", batch_size, capacity))

    def new_paged_cache(self, num_blocks: int, block_size: int, cls: type[PagedKVCache] = PagedKVCache) -> PagedKVCache:
        """A `PagedKVCache` (or subclass ``cls``) for this model: its layers, kv heads, head size,
        activation dtype and device."""
        c, w = self.config, self.embed.weight
        cache = cls(c.num_layers, self.kv_heads, c.head_dim, num_blocks, block_size, w.dtype, w.device)
        return cache if self.lead is None else self.lead.mirror(cache, ("paged", num_blocks, block_size, cls))

    def forward(
        self,
        tokens: Tensor | None,
        positions: Tensor,
        cache: KVCache,
        block_mask: Tensor | None = None,
        logits_at: Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        batch_invariant: bool = False,
        valid: Tensor | None = None,
        embeds: Tensor | None = None,
        packed: bool = False,
        fp32_logits: bool = True,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Logits [B, T or K, V] (fp32) for ``tokens`` [B, T] at RoPE ``positions`` [B, T].

        Writes this pass's K/V at slots ``cache.lengths[b] + t`` and leaves ``lengths``
        alone. Query t of row b sees the row's cached slots and the new tokens s with
        ``block_mask[b, t, s]`` (default causal), always including itself. Positions
        must satisfy ``positions[b, t] <= cache.lengths[b] + t`` (true for chains and
        depth-positioned trees). With ``hidden_layers``, also returns the residual
        stream after those layers ([B, T, H] each; -1 = the final normed hidden).
        ``batch_invariant`` computes every position alone, so that its logits do not depend on
        what else is in the pass: on CPU through the fused block (cpu_block.py, which computes
        its passes that way whether asked or not) or our attention and dense GEMMs
        (invariant.py) beside the int4 / Q8_0 kernels; elsewhere attention runs one query at
        a time over exactly its visible keys (CUDA's linears stay as cuBLAS computes them).
        ``valid`` [B, T] bool marks the real tokens of a padded batch (rows drafting fewer
        tokens than the widest): the linears and the LM head then run on the real tokens
        only, so a row pays for its own draft length, not the batch's widest. Padding may
        write (zero) K/V past its row's length, never visible; its logits come back as 0.
        ``embeds`` [B, T, H] replaces the token embeddings (``tokens`` is then None): a
        learned drafter feeds the layers its own inputs (EAGLE's fused features).
        ``packed`` returns the logits of the real tokens only, [N, V] in the row-major order of
        ``valid``'s True entries (all B·T tokens without ``valid``), instead of [B, T, V] (a
        verify pass with one deep row among 32 would write 32·T·V zeros that nothing reads).
        ``fp32_logits`` False leaves the logits in the head's dtype where no soft cap applies (bf16
        under a bf16 head: a greedy pass that only takes their argmax skips converting them).
        """
        cfg = self.config
        B, T = positions.shape
        if packed and logits_at is not None:
            raise ValueError("packed and logits_at are exclusive")
        bad = [i for i in hidden_layers if not (i == -1 or 0 <= i < cfg.num_layers)]
        if bad:
            raise ValueError(f"hidden_layers must be in [0, {cfg.num_layers}) or -1, got {bad}")
        if self.lead is not None:  # the other ranks run the same pass on their shards
            self.lead.forward(cache, tokens, positions, block_mask=block_mask, logits_at=logits_at,
                              batch_invariant=batch_invariant, valid=valid, embeds=embeds, packed=packed)  # fmt: skip
        kv_len = cache.max_length() + T  # a host sync, unless the cache keeps lengths on the host
        slots = cache.lengths[:, None] + torch.arange(T, device=positions.device)
        step = _Step(cache, slots, kv_len, shard=self.shard)
        if valid is not None and B * T > 1 and not bool(valid.all()):
            step.pack = valid.reshape(-1).nonzero()[:, 0]
        x = step.pack_rows(self.embed(tokens) if embeds is None else embeds)
        if cfg.embed_scale != 1.0 and embeds is None:
            x = x * x.new_tensor(cfg.embed_scale)
        want = set(hidden_layers)
        store = None
        if self.cpu_blocks is not None and self.cpu_blocks.applies(x, self, batch_invariant):
            store = cache.storage_index(slots, kv_len)
            store = store if CpuBlocks.fits(store) else None
        if store is not None:  # one C call per block (cpu_block.py); batch-invariant by construction
            rope = self.rope_angles(FULL, positions)  # the kernel's layers are all FULL
            x, hiddens = self.cpu_blocks.run(x, rope, cache.lengths, store, block_mask, step.pack, want)
        else:
            step.exact = batch_invariant and invariant.exact_kernels(x)
            x, hiddens = self._layers(x, positions, cache, block_mask, valid, batch_invariant, step, want)
        x = self.norm(x)
        hiddens[-1] = x
        if logits_at is not None:
            x = step.unpack(x).gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self._softcap(self._project(x, store is not None, step.exact), fp32_logits)
        if packed:
            logits = logits.reshape(-1, logits.shape[-1])  # [N, V]
        elif logits_at is None:
            logits = step.unpack(logits)  # packed: the LM head ran on the real tokens only
        if not hidden_layers:
            return logits
        return logits, [step.unpack(hiddens[i]) for i in hidden_layers]

    def head_logits(self, x: Tensor, fused: bool = False, fp32: bool = True, exact: bool = False) -> Tensor:
        """Final-normed hidden states [..., H] -> fp32 logits [..., V] (soft-capped where the
        architecture caps them); ``fused``: through the fused CPU block's head; ``exact``: through
        our row-invariant GEMM (invariant.py); ``fp32`` False: in the head's own dtype where
        there is no cap (the cap is computed in fp32)."""
        return self._softcap(self.project_vocab(x, fused, exact), fp32)

    def project_vocab(self, x: Tensor, fused: bool = False, exact: bool = False) -> Tensor:
        """[..., H] -> [..., V] through the LM head alone (no cap), the whole vocabulary."""
        if self.lead is not None:  # a drafter borrowing the head: the other ranks compute their rows
            self.lead.head(x, fused, exact)
        return self._project(x, fused, exact)

    def _project(self, x: Tensor, fused: bool, exact: bool) -> Tensor:
        if fused and self.cpu_blocks is not None:
            logits = self.cpu_blocks.head(x, self.lm_head)
        else:
            logits = invariant.linear(self.lm_head, x) if exact else self.lm_head(x)
        return logits if self.shard is None else self.shard.gather_vocab(logits, self.config.vocab_size)

    def _softcap(self, logits: Tensor, fp32: bool) -> Tensor:
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits.float() if fp32 else logits
        logits = logits.float()
        return torch.tanh(logits / cap) * cap

    def _layers(
        self, x: Tensor, positions: Tensor, cache: KVCache, block_mask: Tensor | None, valid: Tensor | None,
        batch_invariant: bool, step: _Step, want: set[int],
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """The blocks in torch: masks and RoPE tables once, then every layer."""
        cfg = self.config
        B, T = positions.shape
        kv_len = step.kv_len
        ropes = {kind: self.rope_tables(kind, positions, x.dtype) for kind in set(cfg.layer_types)}
        masks = attention_masks(cfg, positions, cache.lengths, block_mask, kv_len)
        if step.exact:  # our attention: each query over the slots it sees
            G = cfg.num_heads // cfg.num_kv_heads
            step.vis = {FULL: invariant.visibility(masks[FULL], cache.lengths, T, kv_len, G, step.pack)}
            if SLIDING in cfg.layer_types:
                same = masks[SLIDING] is masks[FULL]
                step.vis[SLIDING] = step.vis[FULL] if same else invariant.visibility(
                    masks[SLIDING], cache.lengths, T, kv_len, G, step.pack)  # fmt: skip
        elif step.pack is not None and not batch_invariant:
            plan = split_plan(valid, masks, cfg.num_heads // cfg.num_kv_heads)
            if plan is not None:
                step.split, step.split_masks = plan
        if batch_invariant and not step.exact:  # off CPU: one SDPA per query
            step.visible = {FULL: visible_keys(masks[FULL], cache.lengths, T)}
            same = masks[SLIDING] is masks[FULL]  # no window in play: sliding layers see what full ones do
            step.visible[SLIDING] = step.visible[FULL] if same else visible_keys(masks[SLIDING], cache.lengths, T)
        hiddens: dict[int, Tensor] = {}
        for i, (layer, kind) in enumerate(zip(self.layers, cfg.layer_types)):
            x = layer(x, ropes[kind], masks[kind], step)
            if i in want:
                hiddens[i] = x
        return x, hiddens

    def rope_angles(self, kind: str, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin [..., D/2] in fp32 (attention scaling included) for one layer type."""
        freqs = positions[..., None].float() * getattr(self, f"inv_freq_{kind}").float()  # [..., D/2]
        scale = self.rope_scale[kind]
        if scale == 1.0:  # most models: two ops fewer per pass, and x * 1.0 == x exactly
            return freqs.cos(), freqs.sin()
        return freqs.cos() * scale, freqs.sin() * scale

    def rope_tables(self, kind: str, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin [B, T, 1, D] for one layer type, in the activations' dtype."""
        cos, sin = self.rope_angles(kind, positions)
        cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, :, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None, :]
        return cos, sin
