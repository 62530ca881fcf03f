"""
The trained system, written whole at the end of a run (support/run.finish_run):

    OUT/lora_peft/          the LoRA in PEFT's format, its base a path or hub id PEFT can resolve, and the
                            policy's tokenizer beside it
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
from support.checkpoint import write_json
from support.files import replaced, replaced_folder


def base_model_path(spec, out):
    """Where PEFT (AutoModelForCausalLM.from_pretrained) finds the policy's base: a hub id or local folder as
    given; a pocket model's converted float32 folder; a tiny model saved into OUT/base_model (the same name
    always builds the same weights); "" for a shape: model (random weights of a hub shape, for memory checks)."""
    if spec.startswith("tiny:"):
        from support import tiny_models
        model, _ = tiny_models.load(spec[5:])
        folder = os.path.abspath(os.path.join(out, "base_model"))
        with replaced_folder(folder) as tmp:  # written whole, never through a link planted in OUT
            model.save_pretrained(tmp)
        return folder
    if spec.startswith("pocket:"):
        from support import pocket_models
        return str(pocket_models.converted_dir(spec[7:]))
    if spec.startswith("shape:"):
        return ""
    return os.path.abspath(spec) if os.path.isdir(spec) else spec


def export_run(out, policy, tok, method, args, team):
    """OUT/lora_peft (adapter, resolvable base, tokenizer), OUT/g_phi.safetensors and OUT/g_phi.json."""
    from safetensors.torch import save
    base = base_model_path(team["policy"], out)
    with replaced_folder(os.path.join(out, "lora_peft")) as folder:  # whole, never through a planted link
        save_peft(policy, folder, base)
        tok.save_pretrained(folder)
    # detached copies on the CPU: safetensors refuses tensors that share memory
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in method.state_dict().items()}
    with replaced(os.path.join(out, "g_phi.safetensors")) as f:
        f.write(save(state))
    write_json(os.path.join(out, "g_phi.json"),
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
    from support.validation import restore_trained
    meta, g_state = read_g_phi(out)
    args = SimpleNamespace(**{**meta["flags"], "team_models": meta["team_models"]})
    device = torch.device(device)
    dtype = frozen_dtype(getattr(args, "dtype", "auto"), device)
    policy, tok = load_model(meta["team_models"]["policy"], device, dtype)
    method = METHODS[meta["method"]](meta["team_models"], policy.config.hidden_size, args, device, dtype)
    peft = load_file(os.path.join(out, "lora_peft", "adapter_model.safetensors"))
    lora = {k[len("base_model.model."):-len(".weight")]: v.to(device) for k, v in peft.items()}  # save_peft's names
    return restore_trained(policy, tok, method, args, lora, {k: v.to(device) for k, v in g_state.items()})


def read_g_phi(out):
    """(g_phi.json's dict, g_phi's state_dict) of an exported run."""
    from safetensors.torch import load_file
    with open(os.path.join(out, "g_phi.json")) as f:
        meta = json.load(f)
    return meta, load_file(os.path.join(out, "g_phi.safetensors"))


