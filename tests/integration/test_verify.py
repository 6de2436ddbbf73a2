"""The verify loop with the session target on real prompts: exactness, cache bookkeeping, EOS/limits, scoring."""

import copy
import io
import json
import re

import pytest
import torch
from tqdm import tqdm
from transformers import LlamaConfig

from speculators_train.errors import UserError
from speculators_train.families import get
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
from speculators_train.families.eagle3.proposer import Eagle3Proposer
from speculators_train.packed import available, packed_linears
from speculators_train.proposal import DraftTree, Sampling, TreeSpec
from speculators_train.recipe import load_recipe
from speculators_train.target import NO_STATES, StateSpec
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.decoder import SpeculativeDecoder, TargetRunner, decode_plain, verify_width
from speculators_train.verify.oracle import OracleProposer
from speculators_train.verify.run import eos_ids, load_draft_for
from speculators_train.verify.sampling import target_probs
from speculators_train.verify.suites import load_suite
from tests.conftest import REPO, SHAREGPT, chat, make_recipe
from tests.unit.test_sampling_rules import tv, tv_threshold

GREEDY = Sampling()


class NoisyOracle(OracleProposer):
    """The target's own tokens, with every third proposal replaced: acceptance stops at varying depths, so
    the rollback of the target's cache after partial acceptance is exercised."""

    def _next(self, k: int) -> list[int]:
        out = super()._next(k)
        return [t if (self.length + i) % 3 else (t + 1) % 1000 for i, t in enumerate(out)]


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=3, depth=4, budget=10)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "oracle", "noisy"])
def test_greedy_speculative_output_is_the_targets_own(target, prompts, references, random_draft, kind, tree):
    eos = eos_ids(target)
    for prompt, reference in zip(prompts, references, strict=True):
        if kind == "random":
            proposer = get("eagle3").proposer(random_draft, target)
        else:
            proposer = (OracleProposer if kind == "oracle" else NoisyOracle)(prompt + reference)
        result = SpeculativeDecoder(target, proposer, GREEDY, 5, tree).generate(prompt, 40, eos)
        assert result.tokens == reference
        if kind == "oracle":
            k = 5 if tree is None else tree.depth
            # Every step accepts all K drafts, except the last one, cut by the limit or EOS.
            assert all(a == k for a in result.accepted[:-1]), result.accepted
        if kind == "noisy":
            assert set(result.accepted) - {0}, "the noisy oracle never had a partial acceptance"


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=3, depth=4, budget=10)], ids=["chain", "tree"])
def test_greedy_output_is_unchanged_on_packed_weights(target, prompts, references, tree):
    """What `verify` runs on CPU by default: packing changes the GEMM kernel, never the tokens, of the baseline
    or of speculative decoding."""
    eos = eos_ids(target)
    with packed_linears([target.model], verify_width(5, tree)) as packed:
        assert packed == available(target.model)
        for prompt, reference in zip(prompts, references, strict=True):
            assert decode_plain(target, prompt, 40, eos, GREEDY).tokens == reference
            result = SpeculativeDecoder(target, NoisyOracle(prompt + reference), GREEDY, 5, tree).generate(
                prompt, 40, eos
            )
            assert result.tokens == reference
            assert set(result.accepted) - {0}


def test_draft_cache_rolled_back_and_extended_matches_a_fresh_prefill(target, random_draft, prompts):
    """Speculating, then committing, must leave the draft exactly where one prefill of the same pairs would."""
    ids = prompts[0] + [510, 2365, 314, 253, 1345]
    aux, _ = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    aux = aux[0]
    n = len(prompts[0])
    incremental = get("eagle3").proposer(random_draft, target)
    incremental.extend(ids[1:n], aux[: n - 1])
    incremental.propose_chain(4, GREEDY, None)
    incremental.propose_tree(TreeSpec(top_k=3, depth=3, budget=8))
    incremental.extend(ids[n : n + 3], aux[n - 1 : n + 2])
    incremental.propose_chain(2, GREEDY, None)
    incremental.extend(ids[n + 3 :], aux[n + 2 : len(ids) - 1])
    fresh = get("eagle3").proposer(random_draft, target)
    fresh.extend(ids[1:], aux[:-1])
    assert incremental.committed == fresh.committed == len(ids) - 1
    torch.testing.assert_close(incremental.logits, fresh.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(incremental.cache.keys, fresh.cache.keys, rtol=1e-4, atol=1e-4)


class FirstTokens(Eagle3Proposer):
    """Records, for every chain, how many target states were committed and the draft's first token; every
    other chain it offers the target's own next tokens instead (`reference`), so the loop commits several
    states at once after full acceptance."""

    def __init__(self, draft, reference: list[int]) -> None:
        super().__init__(draft, get("eagle3").states(draft.config))
        self.reference = reference
        self.first: list[tuple[int, int]] = []

    def propose_chain(self, k, sampling, generator):
        tokens, q = super().propose_chain(k, sampling, generator)
        self.first.append((self.committed, tokens[0]))
        forced = self.reference[self.committed + 1 : self.committed + 1 + k]  # x_{c+1}: after the pending token
        if len(self.first) % 2 and len(forced) == k:
            tokens = forced
        return tokens, q


def test_the_loop_drafts_what_training_teaches_at_the_same_positions(target, random_draft, prompts, references):
    """Every chain's first token is the teacher-forced TTT step-0 argmax over the final sequence: the loop feeds
    the draft the same (token, state, position) triples training aligns, whether it commits one token or
    several. A shift here only lowers acceptance, which no exactness test sees."""
    draft = copy.deepcopy(random_draft)
    with torch.no_grad():  # unit-gain random layers and a small residual: token and context steer the guess
        for name, p in draft.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                p.normal_(0, p.shape[1] ** -0.5)
        draft.fc.weight.mul_(1e-2)
    proposer = FirstTokens(draft, prompts[0] + references[0])
    out = SpeculativeDecoder(target, proposer, GREEDY, 3).generate(prompts[0], 40, eos_ids(target))
    assert out.tokens == references[0] and max(out.accepted) == 3
    ids = prompts[0] + out.tokens
    seq = torch.tensor([ids], device=target.device)
    with torch.no_grad():
        aux, _ = target.hidden_states(seq, torch.ones_like(seq))
        positions = torch.arange(1, len(ids), device=seq.device)[None]
        logits = draft.ttt_forward(seq[:, 1:], aux[:, :-1], positions, 1)[0][0]
    taught = proposer.targets[logits.argmax(-1)]  # index j: the draft's guess for x_{j+2}
    # The same draft committing 1-4 target states at a time, as the loop does after partial acceptance.
    proposer.reset()
    c = len(prompts[0]) - 1
    proposer.extend(ids[1 : c + 1], aux[0, :c])
    for m in [3, 1, 4, 2] * 8:
        if c + m >= len(ids) - 1:
            break
        proposer.propose_chain(2, GREEDY, None)  # speculated and thrown away by the next extend
        proposer.extend(ids[c + 1 : c + 1 + m], aux[0, c : c + m])
        c += m
        proposer.propose_chain(1, GREEDY, None)
    checked = [(c, token) for c, token in proposer.first if c + 1 < len(ids)]
    assert len(checked) >= 20
    assert [token for _, token in checked] == [int(taught[c - 1]) for c, _ in checked]
    assert len(set(token for _, token in checked)) > 3  # the guesses vary: the inputs steer them


def test_tree_nodes_see_only_their_ancestors(target, random_draft, prompts):
    """A tree's best path is the greedy chain, whatever siblings were drafted beside it (a sibling leaking into
    attention, or a wrong RoPE position per depth, would change the deeper tokens)."""
    ids = prompts[1]
    aux, _ = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    chain_proposer = get("eagle3").proposer(random_draft, target)
    chain_proposer.extend(ids[1:], aux[0, :-1])
    chain, _ = chain_proposer.propose_chain(4, GREEDY, None)
    for spec in (TreeSpec(top_k=1, depth=4, budget=4), TreeSpec(top_k=4, depth=4, budget=40)):
        tree_proposer = get("eagle3").proposer(random_draft, target)
        tree_proposer.extend(ids[1:], aux[0, :-1])
        tree = tree_proposer.propose_tree(spec)
        node, path = -1, []
        for _ in range(4):
            node = tree.children[node][0]  # best child first
            path.append(tree.tokens[node])
        assert path == chain, spec


def test_generation_stops_at_eos_and_at_the_limit_even_when_drafts_run_past(target, prompts, references):
    eos = eos_ids(target)
    prompt, reference = prompts[0], references[0]
    # Pretend the target's 7th token is an end of sequence: drafts (the oracle) keep going past it.
    stop = reference[6]
    got = SpeculativeDecoder(target, OracleProposer(prompt + reference), GREEDY, 5).generate(prompt, 40, {stop})
    assert got.tokens == reference[: reference.index(stop) + 1]
    for limit in (1, 4, 13):
        got = SpeculativeDecoder(target, OracleProposer(prompt + reference), GREEDY, 5).generate(prompt, limit, eos)
        assert got.tokens == reference[:limit]


class TargetSampler:
    """Proposes tokens sampled from the target's own distribution at temperature 1.6 (flatter than the T=1 it is
    verified at), or its argmax (reporting no q) when the sampling asks for argmax drafts: drafts are accepted often
    but not always, so every branch of the rule runs."""

    states = StateSpec()  # reads no target state

    def __init__(self, target, prompt, memo=None):
        self.target, self.seq = target, list(prompt[:1])
        self.memo = {} if memo is None else memo  # prefix -> logits, shared across seeds (the same every run)

    def reset(self, first=None):
        self.seq = self.seq[:1]

    def extend(self, tokens, aux):
        self.seq += tokens

    def propose_chain(self, k, sampling, generator):
        seq, tokens, qs = list(self.seq), [], []
        for _ in range(k):
            if tuple(seq) not in self.memo:
                ids = torch.tensor([seq], device=self.target.device)
                with torch.no_grad():
                    self.memo[tuple(seq)] = self.target.model(ids).logits[0, -1]
            q = torch.softmax(self.memo[tuple(seq)] / 1.6, dim=-1)
            token = int(torch.multinomial(q, 1, generator=generator)) if sampling.samples_drafts else int(q.argmax())
            tokens.append(token)
            qs.append(q)
            seq.append(token)
        return tokens, torch.stack(qs) if sampling.samples_drafts else None

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        raise NotImplementedError


class PrefilledOnce(TargetRunner):
    """A runner for many seeds of one prompt: its prefill runs once, and `reset` crops the cache back to it (the
    entries before a cut are never rewritten, so the cache is what a fresh prefill would make)."""

    def __init__(self, target, prompt, states=NO_STATES):
        super().__init__(target)
        self.prefix = prompt[:-1]
        self.prefilled = super().forward(self.prefix, states=states)  # the states the proposer reads

    def reset(self):
        self.cache.crop(len(self.prefix) - self.length)  # negative: the count of entries to drop

    def forward(self, tokens, tree=None, states=NO_STATES):
        if self.length == len(self.prefix) and tokens == self.prefix:
            return self.prefilled
        return super().forward(tokens, tree, states)


@pytest.mark.parametrize("draft_sampling", ["sample", "argmax"])
def test_sampled_first_and_second_tokens_follow_the_target(target, draft_sampling):
    """T=1 over 300 seeds: the first token (accepted draft or residual) and the second token after the most common
    first token (a correction, or the bonus) match the target's exact distributions within 4x sampling noise, with
    sampled drafts and with argmax drafts (verified as point masses). The target decodes on packed weights, as in
    `verify` (1.5x faster here), with the prompt prefilled once for all seeds; the exact distributions come from its
    plain forward."""
    prompt = chat(target, "Count from 1 to 10, separated by commas.")
    runs = 300
    out, memo = [], {}
    with packed_linears([target.model], verify_width(1, None)):
        runner = PrefilledOnce(target, prompt)
        for seed in range(runs):
            g = torch.Generator(target.device).manual_seed(seed)
            sampling = Sampling(1.0, draft_sampling=draft_sampling)
            decoder = SpeculativeDecoder(target, TargetSampler(target, prompt, memo), sampling, 1)
            decoder.runner = runner
            out.append(decoder.generate(prompt, 2, set(), g))
    accepted = sum(sum(r.accepted) for r in out)
    assert 0 < accepted < sum(len(r.accepted) for r in out), "drafts must be both accepted and rejected"

    def check(prefix, samples):
        with torch.no_grad():
            p = target_probs(target.model(torch.tensor([prefix], device=target.device)).logits[0, -1], Sampling(1.0))
        distance, threshold = tv(samples, p), tv_threshold(p, len(samples))
        assert distance < threshold, f"TV {distance:.3f} vs 4x noise {threshold:.3f}"

    check(prompt, [r.tokens[0] for r in out])
    first = max(set(r.tokens[0] for r in out), key=[r.tokens[0] for r in out].count)
    second = [r.tokens[1] for r in out if r.tokens[0] == first]
    assert len(second) >= 60
    check([*prompt, first], second)


def test_verify_command_writes_json_markdown_plot_and_the_recipe(tmp_path, target, random_draft):
    from speculators_train.verify.run import verify

    save_checkpoint(tmp_path / "ckpt", 1, random_draft, None, {"step": 1}, keep_last=1)
    recipe = load_recipe(
        make_recipe(
            tmp_path,
            [{"name": "sharegpt", "path": SHAREGPT, "max_records": 60}],
            eval={
                "suites": ["eval/suites/sharegpt-held-out.yaml", "eval/suites/sharegpt-code.yaml"],
                "num_prompts": 2,
                "max_new_tokens": 8,
                "temperatures": [0.0, 1.0],
                "mode": "tree",
            },
        )
    )
    out_dir, records = verify(recipe, tmp_path / "ckpt", tmp_path / "out")
    tree = "tree(top_k=4, depth=5, budget=24)"
    # the draftless n-gram baseline (eval.baselines) is decoded beside the draft at T = 0, a chain of the tree's depth
    assert [(r["suite"], r["temperature"], r["shape"]) for r in records] == [
        ("sharegpt-held-out", 0.0, tree),
        ("sharegpt-held-out", 0.0, "ngram(K=5)"),
        ("sharegpt-held-out", 1.0, tree),
        ("sharegpt-code", 0.0, tree),
        ("sharegpt-code", 0.0, "ngram(K=5)"),
        ("sharegpt-code", 1.0, tree),
    ]
    for record in records:
        rates = record["per_position_acceptance"]
        assert record["acceptance_length"] == pytest.approx(1 + sum(rates)) and len(rates) == 5
    assert records[0]["greedy_identical_outputs"] == "2/2" and records[1]["greedy_identical_outputs"] == "2/2"
    assert json.loads((out_dir / "results.json").read_text()) == records
    assert "| sharegpt-code |" in (out_dir / "results.md").read_text()
    assert (out_dir / "acceptance.png").stat().st_size > 10_000
    assert load_recipe(out_dir / "recipe.yaml").eval.mode == "tree"


def test_a_speculators_format_eagle3_made_elsewhere_loads_and_drafts_the_same(tmp_path, target, random_draft, prompts):
    """A directory in the speculators/vLLM format (written here by hand as vLLM reads it, not by our exporter)."""
    from safetensors.torch import save_file

    cfg = random_draft.config
    weights = {k: v.contiguous() for k, v in random_draft.state_dict().items()}
    save_file(weights, tmp_path / "model.safetensors")
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {**cfg.layer_config, "model_type": "llama"},
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    imported = load_draft_for(target, tmp_path).draft
    ids = prompts[0]
    aux, _ = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    mine, theirs = get("eagle3").proposer(random_draft, target), get("eagle3").proposer(imported, target)
    mine.extend(ids[1:], aux[0, :-1])
    theirs.extend(ids[1:], aux[0, :-1])
    torch.testing.assert_close(theirs.logits, mine.logits)
    assert theirs.propose_chain(5, GREEDY, None) == mine.propose_chain(5, GREEDY, None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    assert load_draft_for(target, tmp_path).draft.config.norm_before_residual  # the flag is read, not assumed


def test_a_draft_cast_to_bf16_keeps_rope_frequencies_in_fp32(tmp_path, random_draft):
    """Casting a module casts its float buffers too; RoPE's inv_freq rounded to bf16 shifts far positions."""
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target
    from tests.conftest import tiny_config

    save_checkpoint(tmp_path, 1, random_draft, None, {"step": 1}, keep_last=1)
    bf16 = load_target(TargetConfig(name_or_path=tiny_config().name_or_path, dtype="bfloat16", device="cpu"))
    draft = load_draft_for(bf16, tmp_path / "step-000001").draft
    assert draft.fc.weight.dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(
        draft.rotary_emb.inv_freq, random_draft.rotary_emb.inv_freq.float().cpu(), rtol=0, atol=0
    )


def test_a_draft_for_another_target_or_a_suite_without_prompts_is_refused(tmp_path, target):
    other = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    save_checkpoint(tmp_path, 1, Eagle3Draft(Eagle3Config.for_target(other, [1, 2, 3], 64, False)), None, {}, 1)
    with pytest.raises(UserError, match=r"draft does not fit the target \(hidden size: draft 64, target 128"):
        load_draft_for(target, tmp_path / "step-000001")

    recipe = load_recipe(make_recipe(tmp_path / "r", [{"name": "sharegpt", "path": SHAREGPT, "max_records": 30}]))
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: none\nsplit: held_out\nmatch: 'zzzz-no-such-words-zzzz'\n")
    with pytest.raises(UserError, match=r"suite 'none' found no prompts \(held_out split of .*matching"):
        load_suite(suite, recipe, target)
    suite.write_text("name: bad\nmatch: '(unclosed'\n")
    with pytest.raises(UserError, match=r"suite.yaml: match: .*not a valid regular expression"):
        load_suite(suite, recipe, target)


def test_the_general_chat_suite_leaves_out_what_the_coding_suite_selects(tmp_path, target):
    """sharegpt-chat gates online distillation on coding traffic: it must not hold a single coding request."""
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 30}]))
    suites = REPO / "eval" / "suites"
    chat = load_suite(suites / "sharegpt-chat.yaml", recipe, target)
    code = load_suite(suites / "sharegpt-code.yaml", recipe, target, 64)
    coding = re.compile(code.config.match, re.IGNORECASE)
    assert len(chat.prompts) == 32
    assert not any(coding.search(m["content"]) for p in chat.prompts for m in p.messages if m["role"] == "user")
    assert all(coding.search(next(m["content"] for m in p.messages if m["role"] == "user")) for p in code.prompts)


def test_paired_runs_put_every_setting_right_after_its_prompts_baseline_with_its_seed(target, prompts, monkeypatch):
    """A slow spell on a shared machine must hit a prompt's baseline and its speculative runs alike, so they run
    back to back, prompt by prompt; each setting sees that prompt's own baseline (the oracle replays it: AL K+1)
    and every run of prompt i samples from seed + i."""
    import speculators_train.verify.run as run
    from speculators_train.data.conversations import SkipReport
    from speculators_train.verify.suites import Prompt, Suite, SuiteConfig

    events = []
    plain = run.decode_plain

    def recorded_plain(target, ids, max_new, eos, sampling, g):
        events.append(("target-only", prompts.index(ids), g.initial_seed()))
        return plain(target, ids, max_new, eos, sampling, g)

    def oracle(name):
        def pick(ids, base):
            decoder = SpeculativeDecoder(target, OracleProposer(ids + base.tokens), GREEDY, 3)
            generate = decoder.generate

            def recorded(ids_, max_new, eos, g):
                events.append((name, prompts.index(ids_), g.initial_seed()))
                return generate(ids_, max_new, eos, g)

            decoder.generate = recorded
            return decoder

        return pick

    monkeypatch.setattr(run, "decode_plain", recorded_plain)
    listed = [Prompt(str(i), p, []) for i, p in enumerate(prompts)]
    suite = Suite(SuiteConfig(name="paired"), REPO, listed, SkipReport())
    bar = tqdm(file=io.StringIO())
    baseline, runs = run.run_paired(target, suite, 12, GREEDY, 7, bar, [oracle("a"), oracle("b")])
    assert events == [(name, i, 7 + i) for i in (0, 1) for name in ("target-only", "a", "b")]
    assert bar.n == 6
    for i, prompt in enumerate(prompts):
        assert baseline[i].tokens == plain(target, prompt, 12, eos_ids(target), GREEDY).tokens
        for generations in runs:
            assert generations[i].tokens == baseline[i].tokens
            assert all(a == 3 for a in generations[i].accepted[:-1])


def test_warm_up_runs_both_sides_with_the_decoders_sampling(target, random_draft, prompts, monkeypatch):
    """At T > 0 the first timed baseline would otherwise pay the top-p sort and multinomial's first call alone."""
    import speculators_train.verify.run as run
    from speculators_train.data.conversations import SkipReport
    from speculators_train.verify.suites import Prompt, Suite, SuiteConfig

    seen = []
    plain = run.decode_plain
    monkeypatch.setattr(run, "decode_plain", lambda t, ids, n, eos, s, g: seen.append(s) or plain(t, ids, n, eos, s, g))
    sampling = Sampling(1.0, 0.9)
    decoder = SpeculativeDecoder(target, get("eagle3").proposer(random_draft, target), sampling, 2)
    suite = Suite(SuiteConfig(name="warm"), REPO, [Prompt("0", prompts[0], [])], SkipReport())
    run.warm_up(target, decoder, suite)
    assert seen == [sampling]
