"""`medusa`: K residual heads on the target's final hidden state draft K tokens at once.

Owns: `MedusaNet` (the heads, the trainer's `DraftNet` for ``--method medusa``),
`MedusaOptions` (the ``speculative_config`` keys) and `MedusaDrafter` (chains or a
static tree from the heads' top-k, and each row's newest target feature).
Does not own: the LM head (borrowed from the target, never saved), the folder format
(learned.py), tree shapes (tree.py) or acceptance (verify.py).

Head k (k = 1..K) is a stack of ResBlocks ``h + SiLU(W h + b)`` (W starts at zero, as in
Medusa) followed by the target's LM head. Applied to the target's final normed hidden at
token t, whose own LM head predicts token t + 1, head k predicts token t + 1 + k. The
engine hands the drafter features for ``token_ids[:-1]``; the newest, at token L - 2,
makes head k propose d_k = token L - 1 + k, after the root (the newest token, L - 1).

Losslessness: a chain under sampling draws d_k from q_k, the head's distribution after
the target's temperature / top-k / top-p (heads do not condition on earlier drafts, so
q_k is d_k's law given everything before it), and reports q. Greedy chains and trees
take top-k tokens deterministically (q = None, one-hot), which the verifiers keep exact.
``acceptance: "typical"`` (Medusa's typical acceptance) is the one LOSSY option: drafts
are the heads' argmax and a draft is kept if the target gives it enough probability
(`specdecode.core.verify.typical_verify`); requests decoded with it are flagged ``lossy``.

With ``prompt_lookup_max`` or ``datastore`` (exact acceptance) a row whose context occurred
before drafts the copy instead (lookup.py's wrapper); the heads then draft the other rows
(``copies``), ``num_steps`` deep (default γ), and run not at all in a round where every row copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from specdecode.config import SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.drafters.draft_vocab import DraftVocabHead
from specdecode.drafters.learned import TrainBatch, label_rows, load_net, resolve_weights
from specdecode.drafters.lookup import LookupKeys, drafting_rows
from specdecode.core.batch import Batch
from specdecode.model.transformer import Transformer
from specdecode.core.logits_process import row_states
from specdecode.core.sampling import argmax
from specdecode.core.tree import MAX_TREE_NODES, TreeBatch, TreeShape, parse_token_tree
from specdecode.core.verify import TypicalAcceptance

ACCEPTANCE = ("exact", "typical")
DEFAULT_TREE = "default"  # Medusa's mc_sim_7b_63 tree, cut to γ levels
# FasterDecoding/Medusa medusa/model/medusa_choices.py, mc_sim_7b_63 (63 nodes, 4 levels)
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4  # K: head k predicts the token k past the target's own next token
    num_layers: int = 1  # ResBlocks per head
    draft_vocab: int = 8192  # LM head rows kept (draft_vocab.py); 0 = the whole vocabulary

    def __post_init__(self) -> None:
        if not is_int(self.draft_vocab) or self.draft_vocab < 0:
            raise SpecDecodeError(f"medusa draft_vocab must be an integer >= 0, got {self.draft_vocab!r}")
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value <= 64:
                raise SpecDecodeError(f"medusa {name} must be an integer in [1, 64], got {value!r}")


class ResBlock(nn.Module):
    """h + SiLU(W h + b), W zero at init (the block starts as the identity plus a shift)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, h: Tensor) -> Tensor:
        return h + F.silu(self.linear(h))


class MedusaNet(nn.Module):
    """The K heads, then the target's LM head restricted to the draft vocabulary (not saved)."""

    Config: ClassVar[type] = MedusaConfig
    method: ClassVar[str] = "medusa"
    hidden_layers: tuple[int, ...] = (-1,)

    def __init__(self, config: MedusaConfig, target: Transformer) -> None:
        super().__init__()
        self.config = config
        hidden_size = target.config.hidden_size
        self.head = DraftVocabHead(target, config.draft_vocab)
        self.softcap = target.config.final_logit_softcap
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )

    @classmethod
    def from_target(cls, config: MedusaConfig, target: Transformer) -> MedusaNet:
        return cls(config, target)

    def prepare(self, token_counts: Tensor) -> None:
        """Keep the ``draft_vocab`` most frequent tokens of the training corpus (counts [V])."""
        self.head.prepare(token_counts)

    def forward(self, h: Tensor, num_heads: int) -> Tensor:
        """h [..., H] -> the first ``num_heads`` heads' features [..., K, H]."""
        return torch.stack([head(h) for head in self.heads[:num_heads]], dim=-2)

    def logits(self, features: Tensor) -> Tensor:
        """Head features [..., H] -> fp32 draft-vocabulary logits [..., Vd], as the target's head applies."""
        logits = self.head(features).float()
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap is not None else logits

    def training_loss(self, batch: TrainBatch) -> tuple[Tensor, dict[str, float]]:
        """Head k at token t learns the target's distribution for token t + 1 + k, i.e.
        softmax(logits[:, t + k]) (soft cross-entropy), averaged over heads."""
        h = batch.hidden.to(self.heads[0][0].linear.weight.dtype)  # [B, T, H]
        T = h.shape[1]
        losses: list[Tensor] = []
        metrics: dict[str, float] = {}
        run = batch.mask  # [B, T-k+1] before head k: labels t .. t+k-1 all learned (none across a user turn)
        greedy = batch.argmax()  # [B, T]
        for k in range(1, min(self.config.num_heads, T - 1) + 1):
            run = run[:, : T - k] & batch.mask[:, k:]  # [B, T-k]
            label = F.pad(run, (k, 0))  # [B, T]: head k at t learns the target's at t + k
            count = run.sum().clamp(min=1)
            # the heads, the loss and the metrics only where a label is (chat windows are mostly prompt)
            p = batch.probs_at(self.head.vocab_ids, label)  # [N, Vd]
            h_at = h[:, : T - k].flatten(0, 1)[label_rows(run)]  # [N rounded up, H]
            logq = torch.log_softmax(self.logits(self.heads[k - 1](h_at))[: len(p)], dim=-1)  # [N, Vd]
            losses.append(-(p * logq).sum() / count)
            with torch.no_grad():
                hit = self.head.vocab_ids[argmax(logq)] == greedy[label]  # [N]
                metrics[f"acc@{k}"] = float(hit.sum() / count)
                if k == 1:
                    metrics["alpha@1"] = float(torch.minimum(p, logq.exp()).sum() / count)  # Σ min(p, q)
        if not losses:
            raise SpecDecodeError(f"medusa training windows need at least 2 tokens, got {T}")
        return torch.stack(losses).mean(), metrics

    def saved_state(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if k != "head.linear.weight"}  # rebuilt at load


@dataclass(frozen=True)
class MedusaOptions(LookupKeys):
    model: str | None = None  # folder from `specdecode train --method medusa`; None = shipped weights
    speculative_token_tree: str | list | None = None  # static tree ([(0,), (0, 0), (1,)]) or "default"
    acceptance: str = "exact"  # "typical": Medusa's typical acceptance, LOSSY
    posterior_threshold: float = 0.09  # typical acceptance's ε
    posterior_alpha: float = 0.3  # typical acceptance's δ

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SpecDecodeError(f'medusa "model" must be a folder path, got {self.model!r}')
        if self.acceptance not in ACCEPTANCE:
            raise SpecDecodeError(f"medusa acceptance must be one of {', '.join(ACCEPTANCE)}, got {self.acceptance!r}")
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
                raise SpecDecodeError(f"medusa {name} must be a number in (0, 1], got {value!r}")
            if self.acceptance == "exact" and value != getattr(MedusaOptions, name):
                # silently verifying exactly would leave the user thinking the setting took effect
                raise SpecDecodeError(f'medusa {name} applies to acceptance "typical" only; acceptance is "exact"')
        tree = self.speculative_token_tree
        if tree is not None:
            if self.acceptance == "typical":
                raise SpecDecodeError('medusa acceptance "typical" drafts a chain; drop speculative_token_tree')
            if tree != DEFAULT_TREE and parse_token_tree(tree).num_nodes - 1 > MAX_TREE_NODES:
                raise SpecDecodeError(f"speculative_token_tree has more than {MAX_TREE_NODES} nodes")
            if self.num_steps is not None:  # its shape sets the heads' depth
                raise SpecDecodeError("speculative_token_tree (a static tree) excludes num_steps")
        LookupKeys.__post_init__(self)
        if self.acceptance == "typical" and self.lookup_on:
            raise SpecDecodeError('medusa acceptance "typical" drafts the heads\' chain alone; drop prompt_lookup_max '
                                  "and datastore")  # fmt: skip


class MedusaDrafter:
    Options: ClassVar[type] = MedusaOptions
    Net: ClassVar[type] = MedusaNet
    default_num_speculative_tokens: ClassVar[int] = 4
    hidden_layers: tuple[int, ...] = (-1,)

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        opts: MedusaOptions = spec.options
        path = resolve_weights("medusa", opts.model, ctx.target)
        self.target: Transformer = ctx.target.model
        self.eos_ids = ctx.target.config.eos_token_ids
        self.net: MedusaNet = load_net(MedusaNet, path, self.target, ctx.dtype, ctx.device, ctx.quantization)
        gamma = spec.num_speculative_tokens
        tree = opts.speculative_token_tree
        vocab, have = self.net.head.size, self.net.config.num_heads  # drafts come from the draft vocabulary
        if tree == DEFAULT_TREE:  # cut to γ levels and to the heads there are
            tree = [c for c in MC_SIM_7B_63 if len(c) <= min(gamma, have) and max(c) < vocab]
        self.tree: TreeShape | None = parse_token_tree(tree, vocab, gamma) if tree is not None else None
        self.gamma = gamma
        self.steps = opts.steps(gamma)  # the heads' chain (γ, or num_steps beside a lookup)
        self.depth = max(self.tree.depth) if self.tree is not None else self.steps  # heads used
        if self.depth > have:
            name = "num_steps" if opts.num_steps else "num_speculative_tokens"
            what = f"a tree {self.depth} deep" if self.tree is not None else f"{name} {self.depth}"
            hint = f"; with a lookup, set num_steps to at most {have}" if opts.lookup_on and not opts.num_steps else ""
            raise SpecDecodeError(f"medusa: {what} needs {self.depth} heads, but {path} has {have} heads{hint}")
        self.device = ctx.device
        typical = opts.acceptance == "typical"
        self.typical = TypicalAcceptance(opts.posterior_threshold, opts.posterior_alpha) if typical else None
        self.last = torch.zeros(0, self.target.config.hidden_size, dtype=ctx.dtype, device=ctx.device)  # [B, H]

    def max_draft_tokens(self, num_tokens: int) -> int:
        return self.tree.num_nodes - 1 if self.tree is not None else min(num_tokens, self.depth)

    def prefill(self, batch: Batch, rows: list[int], hidden: list[Tensor] | None = None) -> None:
        assert hidden is not None and len(hidden) == len(rows)
        newest = [h[-1] if len(h) else self.last.new_zeros(self.last.shape[1]) for h in hidden]  # [H] each
        self.last = torch.cat([self.last, torch.stack(newest).to(self.last.dtype)])

    def propose(self, batch: Batch, num_tokens: int, copies: list[list[int]] | None = None) -> Draft:
        K = self.depth if self.tree is not None else min(num_tokens, self.depth)
        logits = self.net.logits(self.net(self.last, K))  # [B, K, Vd]: head k at index k - 1
        if self.tree is not None:  # (a copying row's tree is replaced by its chain)
            return self._fill_tree(batch, logits)
        V = self.target.config.vocab_size
        states = row_states(batch.seqs, self.eos_ids)  # drafts processed as p is (penalties, masks, grammar)
        if batch.all_greedy or self.typical is not None:
            tokens = self.net.head.greedy(logits, V, states)  # [B, K], q one-hot
            draft = Draft(tokens=tokens, acceptance=self.typical)
        else:  # a copying row draws from scratch: its own stream is for its own drafts
            drafting = drafting_rows(copies, batch, self.device)
            tokens, q = self.net.head.sample(logits, batch, V, 0, drafting, states)  # [B, K], [B, K, V]
            draft = Draft(tokens=tokens, q=q)
        return draft

    def _fill_tree(self, batch: Batch, logits: Tensor) -> Draft:
        """The static tree: node i at depth d is head d's ``rank[i]``-th likeliest token (a
        head's logits do not depend on the node's ancestors, so every parent at one depth
        gets the same ranked children). Deterministic: q is one-hot."""
        shape = self.tree
        ranked = self.net.head.vocab_ids[logits.topk(max(shape.rank) + 1, dim=-1).indices]  # [B, K, width]
        depth = torch.tensor(shape.depth[1:], device=logits.device) - 1  # [N-1] head index
        rank = torch.tensor(shape.rank[1:], device=logits.device)  # [N-1]
        roots = batch.last_tokens().to(logits.device)  # [B, 1]
        tokens = torch.cat([roots, ranked[:, depth, rank]], dim=1)  # [B, N]
        parents = torch.tensor(shape.parents, device=logits.device).expand(len(batch), -1).contiguous()  # [B, N]
        return Draft.from_tree(TreeBatch.from_parents(tokens, parents))

    def on_verified(
        self, batch: Batch, num_accepted: Tensor, aux_logits: Tensor | None = None, hidden: Tensor | None = None
    ) -> None:
        assert hidden is not None  # [B, W, H]: the root's and the accepted drafts' features
        index = num_accepted.to(hidden.device)[:, None, None].expand(-1, 1, hidden.shape[-1])
        self.last = hidden.gather(1, index)[:, 0].to(self.last.dtype)  # [B, H] the newest accepted

    def select_rows(self, rows: list[int]) -> None:
        self.last = self.last[torch.tensor(rows, dtype=torch.long, device=self.last.device)]
