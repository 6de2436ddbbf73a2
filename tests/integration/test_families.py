"""Every registered family, through the one protocol the stages use, with the session target on real ShareGPT
records: a fresh draft saves and loads as itself, its objective trains on real states, its proposer decodes the
target's own greedy output in the verify loop, and each export format it writes reads back to the same draft."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from speculators_train import families
from speculators_train.data.splits import load_splits
from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families.drafts import draft_state_dict, load_draft
from speculators_train.families.objective import summarize
from speculators_train.head import TargetHead, load_head_weights
from speculators_train.hidden_states.pipeline import process_chunk
from speculators_train.packed import available, packed_linears
from speculators_train.proposal import Sampling
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.training.data import collate
from speculators_train.verify.decoder import SpeculativeDecoder, TargetRunner, decode_plain
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import SHAREGPT, chat, make_recipe, start_of, tiny_config


@pytest.fixture(scope="module")
def head_weights():
    return load_head_weights(tiny_config())


@pytest.fixture(scope="module")
def samples(tmp_path_factory, target):
    """Real states of 6 ShareGPT records (the recipe's aux layers and the final state, as `generate` stores)."""
    recipe = load_recipe(make_recipe(tmp_path_factory.mktemp("s"), [{"name": "s", "path": SHAREGPT, "max_records": 8}]))
    return process_chunk(recipe, target, load_splits(recipe).train[:6], 0).samples


def fresh_draft(name: str, target, head_weights, samples) -> tuple:
    """(family, its default settings, a fresh draft built from the target and the samples' token counts)."""
    family = families.get(name)
    settings = family.settings(family=family.name)
    config, weights = head_weights
    freq = torch.zeros(target.vocab_size, dtype=torch.int64)
    for sample in samples:
        freq += torch.bincount(sample["input_ids"][sample["loss_mask"]], minlength=target.vocab_size)
    torch.manual_seed(0)
    return family, settings, family.new_draft(settings, start_of(config, weights, freq, target.aux_layer_ids))


@pytest.fixture(params=families.FAMILIES)
def fresh(request, target, head_weights, samples):
    return fresh_draft(request.param, target, head_weights, samples)


def test_a_family_is_registered_under_its_own_name(fresh):
    family, settings, draft = fresh
    assert families.get(family.name) is family and settings.family == family.name
    assert isinstance(draft, family.draft_type)
    # Each declared format resolves to the writer of that very format (a declaration names module:Class by hand).
    assert {name: f.name for name, f in family.formats.items()} == {name: name for name in settings.formats}


def test_save_then_load_gives_the_same_draft_of_the_same_family(tmp_path, target, fresh):
    family, _, draft = fresh
    checkpoint = save_checkpoint(tmp_path, 1, draft, None, {"step": 1}, keep_last=1)
    loaded = load_draft(tmp_path, target.num_layers)  # a checkpoints/ directory resolves to its latest
    assert loaded.family is family and loaded.path == checkpoint and type(loaded.draft) is type(draft)
    mine, theirs = draft_state_dict(draft), draft_state_dict(loaded.draft)
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def test_the_objective_trains_on_real_states_and_sums_every_metric_it_names(target, head_weights, samples, fresh):
    family, settings, draft = fresh
    config, weights = head_weights
    objective = family.objective(draft, TargetHead.from_weights(config, weights), settings)
    batch = collate(samples[:4])
    loss, sums = objective(batch)
    assert torch.isfinite(loss) and loss > 0
    assert sorted(sums) == sorted(objective.metric_keys) and all(pair.shape == (2,) for pair in sums.values())
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters() if p.requires_grad)
    summary = summarize(sums, objective.steps)
    assert 1.0 <= summary[f"predicted_al_{objective.steps}"] <= 1.0 + objective.steps
    assert all(0.0 <= summary[f"full_acc_{i}"] <= 1.0 for i in range(objective.steps))


def test_the_objective_gives_the_same_loss_gradients_and_metrics_over_any_chunk_of_positions(
    head_weights, samples, fresh, monkeypatch
):
    """A loss over a vocabulary is computed over chunks of positions (`chunks.chunked`, checkpointed under
    autograd): one chunk per sample and a few positions per chunk must give the same loss, metric sums and gradients,
    so the memory bound changes no number."""
    import speculators_train.chunks as chunks

    family, settings, draft = fresh
    config, weights = head_weights
    batch = collate(samples[:3])

    def run(elements: int) -> tuple:
        monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", elements)
        draft.zero_grad()
        torch.manual_seed(0)  # families that sample positions draw the same ones
        loss, sums = family.objective(draft, TargetHead.from_weights(config, weights), settings)(batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        return loss.detach(), sums, grads

    whole, sums, grads = run(1 << 40)
    part, part_sums, part_grads = run(1 << 20)  # a few positions per chunk (7 of 3 samples at 49k)
    torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)
    assert part_sums.keys() == sums.keys()
    for name in sums:
        torch.testing.assert_close(part_sums[name], sums[name], rtol=1e-5, atol=1e-5, msg=name)
    assert grads and part_grads.keys() == grads.keys()
    for name in grads:
        # Chunks sum a gradient in another order: compare on the scale of the tensor's largest entry.
        scale = grads[name].abs().max().item()
        torch.testing.assert_close(part_grads[name], grads[name], rtol=1e-4, atol=1e-4 * scale, msg=name)


def loaded_with_prompt(tmp_path, target, draft) -> tuple:
    """The draft saved and loaded for the target as verify loads it, and a chat prompt's ids."""
    save_checkpoint(tmp_path, 1, draft, None, {"step": 1}, keep_last=1)
    return load_draft_for(target, tmp_path), chat(target, "Name three prime numbers.")


def test_the_proposer_decodes_the_targets_own_greedy_output(tmp_path, target, fresh):
    family, _, draft = fresh
    loaded, prompt = loaded_with_prompt(tmp_path, target, draft)
    reference = decode_plain(target, prompt, 24, eos_ids(target), Sampling()).tokens
    k = family.draft_tokens(loaded.draft, 4)
    proposer = family.proposer(loaded.draft, target)
    result = SpeculativeDecoder(target, proposer, Sampling(), k).generate(prompt, 24, eos_ids(target))
    assert result.tokens == reference and len(result.accepted) >= 1
    assert target.aux_layer_ids == [2, 4, 5]  # loading a draft never changes the shared target


@pytest.mark.skipif(not available(torch.nn.Linear(2, 2)), reason="needs a CPU torch built with oneDNN")
def test_the_proposer_drafts_the_same_tokens_on_the_packed_weights_verify_uses(tmp_path, target, fresh):
    """verify runs the target and the draft on oneDNN-packed linears: a draft module whose map is more than a
    Linear's weights must keep its map there (Medusa's residual blocks once became plain linears)."""
    family, _, draft = fresh
    loaded, prompt = loaded_with_prompt(tmp_path, target, draft)
    k = family.draft_tokens(loaded.draft, 4)

    def first_drafts() -> list[int]:
        proposer, runner = family.proposer(loaded.draft, target), TargetRunner(target)
        runner.reset()
        proposer.reset(prompt[0])
        _, states = runner.forward(prompt[:-1], states=proposer.states)
        proposer.extend(prompt[1:], states)
        return proposer.propose_chain(k, Sampling(), None)[0]

    plain = first_drafts()
    with packed_linears([target.model, loaded.draft], k + 1) as packed:
        assert packed
        assert first_drafts() == plain


# Families with a format llama.cpp reads (a GGUF file): those formats read back in tests/e2e/test_gguf_exports.py,
# since llama.cpp's converter runs in a child process.
GGUF_FAMILIES = [f for f in families.FAMILIES if any(fmt.draft_file for fmt in families.get(f).formats.values())]


def assert_export_reads_back(tmp_path, target, fresh, gguf: bool) -> list[str]:
    """Export a fresh draft in each of its family's formats that llama.cpp reads (`gguf`) or each of the others, and
    check that it reads back to the same draft and that `doctor` finds it as trained; the formats checked."""
    from speculators_train.doctor.data import check_verifier
    from speculators_train.doctor.run import serve_checks
    from speculators_train.origin import target_fingerprint

    family, _, draft = fresh
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": family.name})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    checked = []
    for name, fmt in family.formats.items():
        if bool(fmt.draft_file) != gguf:
            continue
        checked.append(name)
        if refused := fmt.unsupported(draft):  # a layout for other targets (MTP's speculators layout: Qwen3's)
            with pytest.raises(UserError, match=re.escape(refused[0])):
                export(recipe, checkpoint, name, tmp_path / name, "float32")
            continue
        out = export(recipe, checkpoint, name, tmp_path / name, "float32").path
        loaded = load_draft(out, target.num_layers)
        assert loaded.family is family and type(loaded.draft) is type(draft), name
        theirs = draft_state_dict(loaded.draft)
        for key, tensor in draft_state_dict(draft).items():
            assert torch.equal(theirs[key], tensor), f"{name}: {key}"
        # `doctor` finds the export as trained, as its engine reads it too (vLLM, SGLang's rules, llama.cpp's GGUF)
        on_disk = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else None
        engine = "llama.cpp" if fmt.draft_file else "sglang" if name == "sglang" else "vllm"
        checks = serve_checks(recipe, load_draft(checkpoint, target.num_layers), out, on_disk, engine)
        assert [c for c in checks if c.status == "fail"] == [], name
        if on_disk and "speculators_config" in on_disk:  # the verifier's revision and config hash, as read now
            provenance = check_verifier(on_disk, recipe.hidden_states_dir, target_fingerprint(recipe.target))
            assert provenance.status == "pass", (name, provenance)
    return checked


def test_every_export_format_reads_back_to_the_same_draft(tmp_path, target, fresh):
    """Every format but GGUF (tests/e2e/test_gguf_exports.py)."""
    family = fresh[0]
    assert assert_export_reads_back(tmp_path, target, fresh, gguf=False) or family.name in GGUF_FAMILIES


FULL_VOCABULARY = [f for f in families.FAMILIES if "draft_vocab_size" in families.get(f).settings.model_fields]


@pytest.mark.parametrize("name", FULL_VOCABULARY)
def test_a_full_vocabulary_export_ships_no_vocabulary_map_and_reads_back(tmp_path, target, head_weights, name):
    """vLLM's EAGLE-3, P-EAGLE and DFlash models hold no d2t at the target's whole vocabulary and refuse a file that
    ships one (tests/e2e/test_vllm.py serves one): the speculators format leaves the identity maps out, and our
    reader puts them back."""
    family = families.get(name)
    settings = family.settings(family=name, **{**family.settings.small.settings, "draft_vocab_size": target.vocab_size})
    config, weights = head_weights
    freq = torch.ones(target.vocab_size, dtype=torch.int64)
    draft = family.new_draft(settings, start_of(config, weights, freq, target.aux_layer_ids))
    assert not draft.d2t.any()
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": name})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "out", "float32").path
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    theirs = draft_state_dict(load_draft(out, target.num_layers).draft)
    for key, tensor in draft_state_dict(draft).items():
        assert torch.equal(theirs[key], tensor), key


def check_parallel_sampling(proposer, draft, vocab_size: int, draws: int) -> None:
    """For a family that proposes every draft token from one forward (P-EAGLE, DFlash), set up on a context: argmax
    drafting reports no q, and each depth's sampled tokens are distributed as the q it reports, which is the
    softmax of its logits at T over its draft vocabulary (the rule verify's rejection sampling relies on)."""
    from speculators_train.families.vocab import draft_to_target
    from speculators_train.proposal import Sampling
    from tests.integration.test_verify import GREEDY
    from tests.unit.test_sampling_rules import tv, tv_threshold

    device = next(draft.parameters()).device
    g = torch.Generator(device=device).manual_seed(0)  # where the draft samples: the target's device
    greedy = proposer.propose_chain(3, GREEDY, None)
    assert proposer.propose_chain(3, Sampling(0.8), g) == (greedy[0], None)
    sampling = Sampling(0.8, draft_sampling="sample")
    sampled, q = [], None
    for _ in range(draws):
        tokens, q = proposer.propose_chain(3, sampling, g)
        sampled.append(tokens)
    logits = proposer.logits(3).float()
    for d in range(3):
        expected = torch.zeros(vocab_size, device=q.device)
        expected[draft_to_target(draft.d2t)] = torch.softmax(logits[d] / 0.8, dim=-1)
        torch.testing.assert_close(q[d], expected)
        samples = [t[d] for t in sampled]
        assert tv(samples, expected) < tv_threshold(expected, len(samples))
