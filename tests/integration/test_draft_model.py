"""The standalone draft model family: its alignment with the target's distribution, its own KV cache in the verify
loop, and what it refuses."""

import json
from pathlib import Path

import pytest
import torch

from speculators_train.errors import UserError
from speculators_train.families import get
from speculators_train.head import TargetHead, load_head_weights
from speculators_train.proposal import Sampling, TreeSpec
from speculators_train.training.data import collate
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.run import eos_ids
from tests.conftest import start_of, tiny_config


@pytest.fixture(scope="module")
def head_weights():
    return load_head_weights(tiny_config())


def new_draft(head_weights, **settings):
    family = get("draft_model")
    config, weights = head_weights
    return family, family.new_draft(family.settings(**settings), start_of(config, weights, torch.zeros(1), []))


def test_a_draft_that_is_the_whole_target_matches_its_distribution_at_every_position(target, head_weights, prompts):
    """Every layer kept: the draft is the target, so the divergence is zero and its top-1 is always the
    target's, which holds only if position t of the draft is scored against the target's state at t."""
    family, draft = new_draft(head_weights, layers=list(range(target.num_layers)))
    ids = torch.tensor(prompts[0])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[len(ids) // 2 :] = True
    with torch.no_grad():
        _, final = target.hidden_states(ids[None], torch.ones_like(ids)[None])
        batch = collate([{"input_ids": ids, "loss_mask": mask, "hidden_state": final[0].cpu()}])
        config, weights = head_weights
        loss, sums = family.objective(draft, TargetHead.from_weights(config, weights), family.settings())(batch)
    assert float(loss) < 1e-4
    assert float(sums["full_acc_0"][0]) == float(sums["full_acc_0"][1]) > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_cache_is_cropped_to_what_was_committed(target, head_weights, prompts, temperature):
    """After proposals (a chain, a tree) and a commit, the proposer's next logits are those of a fresh forward over
    every committed token: nothing it drafted is left in its cache."""
    family, draft = new_draft(head_weights, layers=[0, 1])
    proposer = family.proposer(draft, target)
    prompt = prompts[0]
    proposer.reset(prompt[0])
    proposer.extend(prompt[1:], None)
    generator = torch.Generator().manual_seed(0)
    proposer.propose_chain(3, Sampling(temperature), generator)
    proposer.propose_tree(TreeSpec(top_k=3, depth=3, budget=8))
    proposer.extend([11, 12], None)
    with torch.no_grad():
        fresh = draft(torch.tensor([[*prompt, 11, 12]])).logits[0, -1].float()
    torch.testing.assert_close(proposer.logits, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=2, depth=4, budget=8)], ids=["chain", "tree"])
def test_a_draft_that_is_the_target_has_every_draft_accepted_in_the_loop(
    target, head_weights, prompts, references, tree
):
    """The whole target as its own draft: the loop gives the target's greedy output and accepts all 4 drafts of
    every step (up to float noise between a cached and a batched forward), which needs the draft's cache to hold
    exactly the committed tokens, the first prompt token included, and a tree node's mask and position to be its
    chain's."""
    family, draft = new_draft(head_weights, layers=list(range(target.num_layers)))
    proposer = family.proposer(draft, target)
    result = SpeculativeDecoder(target, proposer, Sampling(), 4, tree).generate(prompts[1], 24, eos_ids(target))
    assert result.tokens == references[1][:24]
    assert sum(result.accepted) >= 0.9 * 4 * len(result.accepted), result.accepted


def test_a_trees_best_path_is_the_greedy_chain_whatever_its_siblings(target, head_weights, prompts, monkeypatch):
    """Siblings fed in the same forward must not see each other (that changes the deeper tokens of the best path),
    and each depth must sit at its chain position (that changes the logits a little, which the last depth's logits
    against one forward over the prompt and the chain show). No greedy-identity test sees either mistake."""
    family, draft = new_draft(head_weights, layers=list(range(target.num_layers)))  # a draft that reads context
    proposer = family.proposer(draft, target)
    prompt = prompts[1]
    proposer.reset(prompt[0])
    proposer.extend(prompt[1:], None)
    chain, _ = proposer.propose_chain(5, Sampling(), None)
    assert len(set(chain)) > 2  # a chain that says something, not one token repeated
    forward, last = draft.forward, []

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        last[:] = [out.logits[0].float()]
        return out

    monkeypatch.setattr(draft, "forward", recording)
    for spec in (TreeSpec(top_k=1, depth=5, budget=5), TreeSpec(top_k=4, depth=5, budget=40)):
        tree = proposer.propose_tree(spec)
        node, path = -1, []
        for _ in range(5):
            node = tree.children[node][0]  # best child first
            path.append(tree.tokens[node])
        assert path == chain, spec
        assert len(tree.tokens) == spec.budget and max(tree.depths) == 5
        if spec.top_k == 1:  # the last forward fed chain[3] alone
            with torch.no_grad():
                fresh = forward(torch.tensor([prompt + chain[:4]])).logits[0, -1].float()
            torch.testing.assert_close(last[0][-1], fresh, rtol=1e-4, atol=1e-4)
    assert proposer.propose_chain(5, Sampling(), None)[0] == chain  # the tree left nothing in the cache


def test_layers_the_target_does_not_have_are_refused(head_weights):
    with pytest.raises(UserError, match=r"draft\.layers \[0, 8\]: the target has 8 layers"):
        new_draft(head_weights, layers=[0, 8])


def test_a_cut_config_keeps_each_kept_layers_kind_and_renumbers_layer_id_lists():
    """Per-layer lists (gpt-oss's `layer_types`, Llama-4's `no_rope_layers` flags) follow the kept layers; lists of
    layer ids (Llama-4's `moe_layers`, even naming every layer) are renumbered to the cut model's ids."""
    from transformers import AutoConfig

    from speculators_train.families.draft_model.family import cut_layers

    oss = AutoConfig.for_model("gpt_oss", num_hidden_layers=8, sliding_window=16)
    kinds = cut_layers(oss, [0, 3]).layer_types
    assert kinds == [oss.layer_types[0], oss.layer_types[3]] and len(set(kinds)) == 2
    llama4 = AutoConfig.for_model("llama4_text", num_hidden_layers=8, interleave_moe_layer_step=1, no_rope_layers=None)
    cut = cut_layers(llama4, [0, 3, 5])
    assert llama4.moe_layers == list(range(8)) and cut.moe_layers == [0, 1, 2]
    assert cut.no_rope_layers == [llama4.no_rope_layers[i] for i in (0, 3, 5)] and cut.num_hidden_layers == 3
    sparse = AutoConfig.for_model("llama4_text", num_hidden_layers=8, interleave_moe_layer_step=2)
    assert sparse.moe_layers == [1, 3, 5, 7] and cut_layers(sparse, [0, 3, 5]).moe_layers == [1, 2]


def test_a_fresh_draft_has_the_asked_shape_its_own_head_and_the_targets_vocabulary(head_weights):
    """`start: fresh` changes only the config keys it names; a misspelt key is refused, not ignored."""
    small = {"num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2}
    _, draft = new_draft(head_weights, start="fresh", fresh_config={**small, "num_key_value_heads": 1})
    cfg = draft.config.lm_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (1, 128, 1, 49152)
    assert not cfg.tie_word_embeddings
    assert draft.lm.lm_head.weight.data_ptr() != draft.lm.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert draft(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 49152)
    with pytest.raises(UserError, match=r"draft\.fresh_config\.hidden_sise: not a setting of the target's llama"):
        new_draft(head_weights, start="fresh", fresh_config={"hidden_sise": 128})


def test_a_starting_model_with_another_tokenizer_is_refused(tmp_path, head_weights):
    """Draft ids are verified as target ids: a model whose tokenizer maps one id to another token cannot draft."""
    import shutil

    config, _ = head_weights
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source := Path(config._name_or_path) / name).is_file():
            shutil.copy(source, tmp_path / name)
    (tmp_path / "model.safetensors").symlink_to(Path(config._name_or_path) / "model.safetensors")
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(UserError, match=r"draft\.start '.*': its tokenizer is not the target's"):
        new_draft(head_weights, start=str(tmp_path))


def test_the_recipe_refuses_layer_lists_it_cannot_build(tmp_path):
    from speculators_train.recipe import load_recipe
    from tests.conftest import SHAREGPT, make_recipe

    path = make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "draft_model"})
    assert load_recipe(path).export.format == "hf"  # its family's first format, not EAGLE-3's default
    assert load_recipe(path, {"eval.mode": "tree"}).eval.mode == "tree"
    with pytest.raises(UserError, match=r"draft\.layers \[2, 1\]: ascending, distinct"):
        load_recipe(path, {"draft.layers": [2, 1]})


# SGLang's LlamaForCausalLM.load_weights (python/sglang/srt/models/llama.py): these checkpoint names load into one
# stacked parameter each, by shard.
SGLANG_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
SGLANG_LAYER_PARAMS = (
    "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip


def test_sglang_standalone_loads_every_tensor_of_the_folder_with_its_own_head(tmp_path, fitted):
    """SGLang's STANDALONE worker loads the draft as a plain model with its own embedding and head (it calls
    TpModelWorker, not the EAGLE worker that takes the target's), through LlamaForCausalLM.load_weights: q/k/v and
    gate/up are stacked, lm_head is dropped when tie_word_embeddings is true, and a name it does not know is skipped
    with a warning. Every tensor we write lands on a parameter, every parameter shard is written, and the trained,
    untied head is what it loads."""
    from safetensors import safe_open

    from speculators_train.export.run import export

    recipe, checkpoint, _, _ = fitted("draft_model")
    out = export(recipe, checkpoint, "hf", tmp_path / "hf").path
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    loaded: dict[str, set] = {}
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    for name in names:
        if "rotary_emb.inv_freq" in name or (config["tie_word_embeddings"] and "lm_head.weight" in name):
            continue
        stacked = next(((param, weight, shard) for param, weight, shard in SGLANG_STACKED if weight in name), None)
        key, shard = (name.replace(stacked[1], stacked[0]), stacked[2]) if stacked else (name, None)
        loaded.setdefault(key, set()).add(shard)
    layers = range(config["num_hidden_layers"])
    params = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    params |= {f"model.layers.{i}.{p}" for i in layers for p in SGLANG_LAYER_PARAMS}
    assert set(loaded) == params
    for name, shards in loaded.items():
        expected = {"qkv_proj": {"q", "k", "v"}, "gate_up_proj": {0, 1}}
        assert shards == next((v for k, v in expected.items() if k in name), {None}), name
    assert head.shape == embed.shape and not torch.equal(head, embed)  # trained apart: a tied load would lose it
    printed = get("draft_model").formats["hf"].commands(out, "HuggingFaceTB/SmolLM2-135M-Instruct", recipe.eval, 4)
    assert any(
        f"--speculative-algorithm STANDALONE --speculative-draft-model-path {out} --speculative-num-steps 4 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 5" in line
        for line in printed
    )
