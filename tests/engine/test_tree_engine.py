"""Tree rounds through the engine: any accepted path (including through a later sibling)
leaves the cache as a fresh prefill would, so greedy output equals plain greedy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.base import Draft
from specdecode.engine.cost import VerifyCost
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from specdecode.core.tree import TreeBatch
from tests.engine.checks import serve_all
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11, 12], [2, 3, 2, 3, 2]]
STEPS = 24


class OracleTreeDrafter:
    """Proposes random trees in which one random path follows the reference greedy
    continuation for a random number of steps; every other node is a wrong token."""

    hidden_layers = ()

    def __init__(self, reference: dict[tuple, list[int]], seed: int, nodes: int) -> None:
        self.reference, self.rng, self.nodes = reference, torch.Generator().manual_seed(seed), nodes
        self.moved_paths = 0
        self.prompts: list[tuple] = []

    def max_draft_tokens(self, num_tokens: int) -> int:
        return self.nodes - 1

    def prefill(self, batch, rows, hidden=None) -> None:
        self.prompts += [tuple(batch.seqs[r].token_ids[: batch.seqs[r].num_prompt]) for r in rows]

    def select_rows(self, rows) -> None:
        self.prompts = [self.prompts[r] for r in rows]

    def on_verified(self, batch, num_accepted, aux_logits=None, hidden=None) -> None:
        pass

    def _randint(self, high: int) -> int:
        return int(torch.randint(high, (1,), generator=self.rng))

    def propose(self, batch, num_tokens: int) -> Draft:
        N = self.nodes
        tokens = torch.full((len(batch), N), -1, dtype=torch.long)
        parents = torch.full((len(batch), N), -1, dtype=torch.long)
        for b, seq in enumerate(batch.seqs):
            ref = self.reference[self.prompts[b]]
            done = len(seq.token_ids) - seq.num_prompt  # reference tokens already emitted
            truth = ref[done : done + num_tokens]
            tokens[b, 0] = seq.token_ids[-1]
            for n in range(1, N):  # random shape: each node hangs under a random earlier node
                parents[b, n] = self._randint(n)
                tokens[b, n] = self._randint(64)
            # walk one random root-to-node path and make its first k tokens correct,
            # keeping every sibling on the way distinct from them (siblings must be distinct).
            node, depth = 0, 0
            keep = self._randint(len(truth) + 1)
            while depth < keep:
                kids = [c for c in range(1, N) if parents[b, c] == node]
                if not kids:
                    break
                node = kids[self._randint(len(kids))]
                if kids.index(node) > 0:
                    self.moved_paths += 1
                for k in kids:
                    if k != node and tokens[b, k] == truth[depth]:
                        tokens[b, k] = (truth[depth] + 1) % 64
                tokens[b, node] = truth[depth]
                depth += 1
            # deduplicate the remaining siblings so the tree is well formed
            for parent in range(N):
                seen: set[int] = set()
                for c in range(1, N):
                    if parents[b, c] == parent:
                        while int(tokens[b, c]) in seen:
                            tokens[b, c] = (tokens[b, c] + 1) % 64
                        seen.add(int(tokens[b, c]))
        return Draft.from_tree(TreeBatch.from_parents(tokens, parents))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tree") / "m", "llama", seed=0, vocab_size=64)
    target = load_model(str(path), dtype="float32", device="cpu")
    plain = ServingEngine(target, None, max_model_len=256)
    params = [SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)] * len(PROMPTS)
    reference = {}
    outputs = serve_all(plain, PROMPTS, params)
    for p, out in zip(PROMPTS, outputs):
        reference[tuple(p)] = out
    return target, reference, params


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), nodes=st.integers(2, 12), batch=st.sampled_from([1, 4]))
def test_random_trees_keep_greedy_exact(setup, seed, nodes, batch):
    target, reference, params = setup
    drafter = OracleTreeDrafter(reference, seed, nodes)
    engine = ServingEngine(target, SpecConfig("oracle", 4), max_model_len=256, drafter=drafter)
    prompts = PROMPTS[:batch]
    outputs = serve_all(engine, prompts, params[:batch])
    assert outputs == [reference[tuple(p)] for p in prompts]


def test_paths_through_later_siblings_are_exercised(setup):
    target, reference, params = setup
    drafter = OracleTreeDrafter(reference, seed=7, nodes=10)
    engine = ServingEngine(target, SpecConfig("oracle", 4), max_model_len=256, drafter=drafter)
    outs = serve_all(engine, PROMPTS, params)
    assert outs == [reference[tuple(p)] for p in PROMPTS]
    assert drafter.moved_paths > 5  # the accepted path often leaves nodes 0..k: the cache had to compact


@pytest.mark.parametrize("method", ["ngram", "lookahead"])
def test_the_adaptive_budget_prices_a_tree_pass_by_its_nodes(setup, method):
    """The verify-cost curve is fitted on what each pass really verified: a tree pass's nodes
    (it logged rows + depth, so tree passes read as smaller and cheaper than they were), and
    with lookahead's aux branch, the padded layout the pass computes."""
    target, _, params = setup
    options = {"ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 3, "max_matches": 3}, "lookahead": {}}[method]
    spec = parse_spec({"method": method, "num_speculative_tokens": 4, **options, "verify_budget": "adaptive"})
    engine = ServingEngine(target, spec, max_model_len=256)
    engine.budget.cost = VerifyCost([(1, 1.0), (512, 1.0)])  # passes cost alike: draft what may pay (not timing)
    verified, logged = [], []
    verify, add = engine._verify_round, engine.budget.passes.add

    def spy_verify(batch, cache, draft):
        if draft is not None and draft.aux is not None:
            verified.append(draft.tree.tokens.numel() + draft.aux.tokens.numel())  # [B, N + A], padded
        elif draft is not None and draft.tree is not None:
            verified.append(int(draft.tree.valid.sum()))  # every row's root and nodes
        else:
            verified.append(len(batch) + (int(draft.num_tokens.sum()) if draft is not None else 0))
        return verify(batch, cache, draft)

    engine._verify_round = spy_verify
    engine.budget.passes.add = lambda one, cost: (logged.append(one[0]), add(one, cost))[1]
    copying = [[5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6, 8] * 2, [9, 10, 9, 11, 9, 10, 9, 11] * 2]
    outputs = serve_all(engine, copying, params[:2])
    assert logged == verified and any(n > len(copying) + 4 for n in verified)  # some pass was a wide tree
    assert len(outputs) == 2
